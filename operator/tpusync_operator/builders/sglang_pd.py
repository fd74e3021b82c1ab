"""sglang-jax's own prefill/decode disaggregation (pure builders).

The contract, from sglang-jax's source (python/sgl_jax/srt/disaggregation/, main branch since
June 2026; no release carried it by August 2026, so spec.engine.image is required: a build of it):
- one bootstrap server per serving (`python -m sgl_jax.srt.disaggregation.run_bootstrap`,
  HTTP on 8998, `/health` open, every other path behind the shared secret's Bearer token):
  prefill engines register there, decode engines pick a registered prefill by a request's
  `bootstrap_room`;
- engines run with `--disaggregation-mode prefill|decode --disaggregation-bootstrap-url`, pull KV
  over jax.experimental.transfer (port 30001) and acknowledge over a ZMQ side channel (9600),
  published under `--disaggregation-host-ip` (a routable address: the pod IP);
- P/D needs `--page-size` >= 128, and prefix (radix) cache reuse is not supported with it;
- one shared secret (`SGL_JAX_PD_SHARED_SECRET`, a string) authenticates all three channels;
- a request reaches prefill and decode at once with the same `bootstrap_room`: llm-d's routing
  proxy does that with `--kv-connector=sglang`.
"""

from __future__ import annotations

import base64
from typing import Any

from .. import versions
from ..models import DisaggregatedServingSpec
from . import names
from .common import COMPONENT_LABEL, SERVING_LABEL, Owner, base_labels, metadata
from .security import container_security_context, pod_security_context

BOOTSTRAP_PORT = 8998
PORTS = {"pd-transfer": 30001, "pd-side": 9600}
PAGE_SIZE = 128
SECRET_ENV = "SGL_JAX_PD_SHARED_SECRET"
SECRET_KEY = "secret"
COMPONENT = "pd-bootstrap"


def bootstrap_url(owner: Owner) -> str:
    return f"http://{names.pd_bootstrap(owner.name)}.{owner.namespace}.svc:{BOOTSTRAP_PORT}"


def engine_args(owner: Owner, role: str) -> list[str]:
    return ["--page-size", str(PAGE_SIZE), "--disable-radix-cache",
            "--disaggregation-mode", role,
            "--disaggregation-bootstrap-url", bootstrap_url(owner),
            "--disaggregation-transfer-port", str(PORTS["pd-transfer"]),
            "--disaggregation-side-channel-port", str(PORTS["pd-side"]),
            "--disaggregation-host-ip", "$(POD_IP)"]


def secret_env(owner: Owner) -> dict[str, Any]:
    return {"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": names.pd_secret(owner.name),
                                                               "key": SECRET_KEY}}}


def build_secret(owner: Owner, secret: str) -> dict[str, Any]:
    """Created once (never re-applied: that would change the secret under running engines)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": metadata(owner, names.pd_secret(owner.name), base_labels(owner, COMPONENT)),
            "data": {SECRET_KEY: base64.b64encode(secret.encode()).decode()}}


def _selector(owner: Owner) -> dict[str, str]:
    return {SERVING_LABEL: owner.name, COMPONENT_LABEL: COMPONENT}


def build_bootstrap_deployment(owner: Owner, spec: DisaggregatedServingSpec) -> dict[str, Any]:
    """The registry: CPU only, no TPU toleration. Its pod carries the serving label, so the
    serving's NetworkPolicy admits exactly the serving's own pods to it."""
    name = names.pd_bootstrap(owner.name)
    labels = {**base_labels(owner, COMPONENT), **_selector(owner)}

    def probe(**timing: int) -> dict[str, Any]:
        return {"httpGet": {"path": "/health", "port": BOOTSTRAP_PORT}, **timing}
    container = {
        "name": "bootstrap",
        "image": versions.from_registry(spec.engine.image or ""),   # the engine's image, as engine_image renders it
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["python", "-m", "sgl_jax.srt.disaggregation.run_bootstrap"],
        "args": ["--host", "0.0.0.0", "--port", str(BOOTSTRAP_PORT)],
        "env": [secret_env(owner), {"name": "HOME", "value": "/tmp"}],
        "ports": [{"name": "bootstrap", "containerPort": BOOTSTRAP_PORT, "protocol": "TCP"}],
        "readinessProbe": probe(periodSeconds=5),
        "livenessProbe": probe(initialDelaySeconds=10, periodSeconds=10),
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": container_security_context(read_only_root=True),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": metadata(owner, name, labels),
            "spec": {"replicas": 1,
                     # The registry is in memory: a second replica would split it.
                     "strategy": {"type": "Recreate"},
                     "selector": {"matchLabels": _selector(owner)},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"automountServiceAccountToken": False,
                                           "enableServiceLinks": False,
                                           "securityContext": pod_security_context(),
                                           "containers": [container],
                                           "volumes": [{"name": "tmp", "emptyDir": {}}]}}}}


def build_bootstrap_service(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(owner, names.pd_bootstrap(owner.name), base_labels(owner, COMPONENT)),
            "spec": {"selector": _selector(owner),
                     "ports": [{"name": "bootstrap", "port": BOOTSTRAP_PORT, "targetPort": BOOTSTRAP_PORT,
                                "protocol": "TCP"}]}}
