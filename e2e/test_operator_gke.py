"""A TPUSyncPool in mode gke on the real control plane, with the operator process talking to
the GKE API contract server (tests/support/gke_api.py: the documented
nodePools/operations API and the metadata server's token, on 127.0.0.1; it is not GKE).

The operator creates the node pool through the API; the test plays GKE's part of bringing
the nodes up (kwok nodes labelled with the node pool). Only this pool carries the
operator's finalizer; deleting it deletes the node pool through the API before the object
goes. GKE completes operations on its own, so the server completes them after a second.
"""

from __future__ import annotations

import pytest
from test_operator import FINALIZER, apply, get, wait_condition

from tests.support.gke_api import PARENT, serve
from tests.support.polling import wait_for

NODE_POOL = "e2e-gke-v6e"


@pytest.fixture
def gke_operator(operator):
    """The session's operator, restarted with the contract server as GKE and metadata server."""
    state, url, stop = serve()
    state.done_after_s = 1.0
    saved = dict(operator.extra_env)
    operator.stop()
    operator.extra_env.update({"TPUSYNC_GKE_ENDPOINT": url, "TPUSYNC_METADATA_URL": url})
    operator.start()
    try:
        yield state
    finally:
        operator.stop()
        operator.extra_env.clear()
        operator.extra_env.update(saved)
        operator.start()
        stop()


def test_gke_pool_creates_and_deletes_its_node_pool(cluster, gke_operator, module_namespace):
    ns, state = module_namespace, gke_operator
    apply(cluster, {"apiVersion": "tpusync.dev/v1alpha1", "kind": "TPUSyncPool",
                    "metadata": {"name": "g", "namespace": ns},
                    "spec": {"tpu": {"type": "v6e", "topology": "2x2"}, "capacity": {"hosts": 2},
                             "provisioning": {"mode": "gke", "gke": {
                                 "project": "proj", "location": "us-central1", "cluster": "c1",
                                 "nodePoolName": NODE_POOL, "nodeLocations": ["us-central1-b"]}},
                             "tiers": {"dram": "8Gi"}}})
    wait_for("the node pool created through the API", lambda: NODE_POOL in state.pools, 60)
    created = state.pools[NODE_POOL]
    assert created["initialNodeCount"] == 2 and created["locations"] == ["us-central1-b"]
    assert created["config"]["machineType"] == "ct6e-standard-4t"
    assert created["config"]["labels"] == {"tpusync.dev/pool": "g", "tpusync.dev/namespace": ns}
    cluster.add_tpu_nodes(NODE_POOL, 2, topology="2x2", chips_per_node=4)    # GKE's part

    pool = wait_condition(cluster, "tpusyncpool", ns, "g")
    assert pool["status"]["readyHosts"] == 2
    assert pool["status"]["nodePool"]["name"] == NODE_POOL and pool["status"]["nodePool"]["state"] == "RUNNING"
    assert pool["metadata"]["finalizers"] == [FINALIZER]     # a cloud resource to delete
    assert all(auth == "Bearer good" for m, p, auth in state.requests if p.startswith(PARENT))

    # kubectl delete returns once the finalizer is released: after GKE reports the pool gone.
    cluster.kubectl("delete", "tpusyncpool", "g", "-n", ns, "--timeout=90s", timeout=120)
    assert get(cluster, "tpusyncpool", ns, "g") is None
    assert ("DELETE", f"{PARENT}/nodePools/{NODE_POOL}") in state.mutations()
    assert NODE_POOL not in state.pools
