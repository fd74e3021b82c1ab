"""TPUSyncPools in mode gke on the real control plane, with the operator process talking to
the GKE API contract server (tests/support/gke_api.py: the documented nodePools/operations
API and the metadata server's token, on 127.0.0.1; it is not GKE), configured as the chart
configures it (TPUSYNC_GKE_ENDPOINT, the value gke.endpoint): the only GKE API it calls.

The operator creates the node pool through the API, marked as the pool's (labels with the
pool's uid); the test plays GKE's part of bringing the nodes up (kwok nodes labelled with the
node pool). Only this pool carries the operator's finalizer; deleting it deletes the node
pool through the API before the object goes. A node pool of the wanted name that the
operator did not create is never resized or deleted, and the pool says so. A pool cannot
name another GKE API (the field is gone from the CRD): the token goes nowhere else. GKE
completes operations on its own, so the server completes them after a second.
"""

from __future__ import annotations

import json

import pytest
from test_operator import FINALIZER, apply, conditions, get, wait_condition

from tests.support.gke_api import PARENT, serve
from tests.support.polling import wait_for

NODE_POOL = "e2e-gke-v6e"
FOREIGN = "e2e-gke-foreign"
NOT_NAMED = "e2e-gke-endpoint"


@pytest.fixture(scope="module")
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


def gke_pool(ns: str, name: str, node_pool: str, hosts: int) -> dict:
    return {"apiVersion": "tpusync.dev/v1alpha1", "kind": "TPUSyncPool",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"tpu": {"type": "v6e", "topology": "2x2"}, "capacity": {"hosts": hosts},
                     "provisioning": {"mode": "gke", "gke": {
                         "project": "proj", "location": "us-central1", "cluster": "c1",
                         "nodePoolName": node_pool, "nodeLocations": ["us-central1-b"]}},
                     "tiers": {"dram": "8Gi"}}}


def calls_about(state, node_pool: str) -> list[tuple[str, str]]:
    return [(m, p) for m, p in state.mutations() if p.startswith(f"{PARENT}/nodePools/{node_pool}")]


def test_gke_pool_creates_and_deletes_its_node_pool(cluster, gke_operator, module_namespace):
    ns, state = module_namespace, gke_operator
    apply(cluster, gke_pool(ns, "g", NODE_POOL, hosts=2))
    wait_for("the node pool created through the API", lambda: NODE_POOL in state.pools, 60)
    created = state.pools[NODE_POOL]
    assert created["initialNodeCount"] == 2 and created["locations"] == ["us-central1-b"]
    assert created["config"]["machineType"] == "ct6e-standard-4t"
    uid = get(cluster, "tpusyncpool", ns, "g")["metadata"]["uid"]
    assert created["config"]["labels"] == {"tpusync.dev/pool": "g", "tpusync.dev/namespace": ns,
                                           "tpusync.dev/managed-by": "tpusync-operator",
                                           "tpusync.dev/owner-uid": uid}
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


def test_a_node_pool_the_operator_did_not_create_is_never_changed_or_deleted(cluster, gke_operator,
                                                                              module_namespace):
    """A pool naming an existing node pool without the operator's mark (here one of a single
    node, where the spec asks for two): no setSize, no delete when the pool is deleted; the
    pool's conditions name the node pool and the way out."""
    ns, state = module_namespace, gke_operator
    with state.lock:
        state.pools[FOREIGN] = {"name": FOREIGN, "status": "RUNNING", "initialNodeCount": 1,
                                "locations": ["us-central1-b"],
                                "config": {"machineType": "ct6e-standard-4t", "labels": {"team": "someone-else"}}}
        state.sizes[FOREIGN] = 1
    apply(cluster, gke_pool(ns, "f", FOREIGN, hosts=2))
    pool = wait_condition(cluster, "tpusyncpool", ns, "f", "Degraded", "True", reason="NodePoolNotOwned")
    message = conditions(pool)["Degraded"]["message"]
    assert f"GKE node pool {FOREIGN} exists but the operator did not create it" in message
    assert f"tpusync.dev/owner-uid={pool['metadata']['uid']}" in message
    assert "spec.provisioning.gke.nodePoolName" in message and f"delete node pool {FOREIGN} yourself" in message
    ready = conditions(pool)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "NodePoolNotOwned")
    assert pool["status"]["nodePool"]["state"] == "NotOwned"
    wait_for("the NodePoolNotOwned event", lambda: [
        e for e in cluster.kubectl_json("get", "events", "-n", ns)["items"]
        if e["involvedObject"].get("name") == "f" and e["reason"] == "NodePoolNotOwned"
        and e["type"] == "Warning"], 30)
    assert pool["metadata"]["finalizers"] == [FINALIZER]

    cluster.kubectl("delete", "tpusyncpool", "f", "-n", ns, "--timeout=90s", timeout=120)
    assert get(cluster, "tpusyncpool", ns, "f") is None
    assert calls_about(state, FOREIGN) == []                  # never resized, never deleted
    assert state.pools[FOREIGN]["status"] == "RUNNING" and state.sizes[FOREIGN] == 1


def test_a_pool_cannot_name_the_gke_api_its_token_goes_to(cluster, gke_operator, module_namespace):
    """spec.provisioning.gke.apiEndpoint is gone: kubectl (strict field validation, its
    default) is refused naming the field; a client asking for no validation has it pruned by
    the API server (the schema is structural and preserves no unknown field), and the
    operator calls the endpoint of its configuration only: the other server gets no request,
    no token."""
    ns, state = module_namespace, gke_operator
    elsewhere, elsewhere_url, stop = serve()
    try:
        body = gke_pool(ns, "ep", NOT_NAMED, hosts=1)
        body["spec"]["provisioning"]["gke"]["apiEndpoint"] = elsewhere_url
        res = cluster.kubectl("apply", "-f", "-", input=json.dumps(body), check=False)
        assert res.returncode != 0, res.stdout
        assert "unknown field" in res.stderr and "spec.provisioning.gke.apiEndpoint" in res.stderr, res.stderr
        assert get(cluster, "tpusyncpool", ns, "ep") is None

        cluster.kubectl("create", "--validate=false", "-f", "-", input=json.dumps(body))
        stored = get(cluster, "tpusyncpool", ns, "ep")
        assert "apiEndpoint" not in stored["spec"]["provisioning"]["gke"]
        wait_for("the node pool created through the configured API",
                 lambda: state.pools.get(NOT_NAMED, {}).get("status") == "RUNNING", 60)
        cluster.kubectl("delete", "tpusyncpool", "ep", "-n", ns, "--timeout=90s", timeout=120)
        assert NOT_NAMED not in state.pools
    finally:
        stop()
    assert elsewhere.requests == []
