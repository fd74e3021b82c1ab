"""tpusync Kubernetes operator: TPUSyncPool and DisaggregatedServing.

Layers (imports point downwards only):
  handlers / __main__     kopf registration and process entry point
  reconcile               the one level-based reconcile per kind (talks to the API server)
  kube, gke               thin I/O clients
  pool_plan, serving_plan pure decisions (ownership: which objects a pass may write)
  status, ownership
  builders                pure child-object builders
  models, tpu, quantity   the API (single source of truth for the CRDs) and pure helpers
"""

GROUP = "tpusync.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
FIELD_MANAGER = "tpusync-operator"

__all__ = ["API_VERSION", "FIELD_MANAGER", "GROUP", "VERSION"]
