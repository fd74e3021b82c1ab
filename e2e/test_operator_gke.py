"""TPUSyncPools in mode gke on the real control plane, with the operator process talking to
the GKE API contract server (harness/gke_api.py: the documented nodePools/operations
API and the metadata server's token, on 127.0.0.1; it is not GKE), configured as the chart
configures it (TPUSYNC_GKE_ENDPOINT, the value gke.endpoint): the only GKE API it calls.

The operator creates the node pool through the API, marked as the pool's (labels with the
pool's uid); the test plays GKE's part of bringing the nodes up (kwok nodes labelled with the
node pool). Only this pool carries the operator's finalizer; deleting it deletes the node
pool through the API before the object goes. A node pool of the wanted name that the
operator did not create is never resized or deleted, and the pool says so. A pool cannot
name another GKE API (the field is gone from the CRD): the token goes nowhere else. An
autoscaled multi-host pool is a node pool per slice, which GKE's autoscaler grows whole (the
test plays that part too). GKE completes operations on its own, so the server completes them
after a second.
"""

from __future__ import annotations

import json

import pytest
from test_operator import FINALIZER, apply, conditions, get, serving_obj, wait_condition
from test_operator_ownership import RECOVERY, create, service

from harness.gke_api import PARENT, serve
from harness.polling import wait_for

NODE_POOL = "e2e-gke-v6e"
HELD = "e2e-gke-held"
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
                         "project": "my-project", "location": "us-central1", "cluster": "c1",
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


def test_a_name_conflict_stops_the_pass_before_gke_is_called(cluster, operator, gke_operator, module_namespace):
    """Another team's Service at the pool's <pool>-peers name stops the pass before it writes
    anything, the GKE node pool included (a node pool costs money and no child could use it);
    once theirs is gone, the pool creates its node pool by itself."""
    ns, state = module_namespace, gke_operator
    create(cluster, service("h-peers", ns))
    apply(cluster, gke_pool(ns, "h", HELD, hosts=1))
    pool = wait_condition(cluster, "tpusyncpool", ns, "h", "Degraded", "True", reason="NameConflict")
    message = conditions(pool)["Degraded"]["message"]
    assert f"Service {ns}/h-peers" in message
    assert pool["status"].get("nodePool", {}).get("state") is None   # never reported: GKE was not asked
    # The retry after the conflict (ownership.CONFLICT_RETRY_SECONDS) finds it still held: still nothing.
    marker = f"failed temporarily: {message.split(';')[0]}"
    first = wait_for("the pass's retry in the log", lambda: operator.log_text().count(marker), 30)
    wait_for("the pool's pass to run again", lambda: operator.log_text().count(marker) > first, RECOVERY)
    assert calls_about(state, HELD) == [] and HELD not in state.pools

    cluster.kubectl("delete", "service", "h-peers", "-n", ns, "--wait=true")
    wait_for("the node pool created once the name is free", lambda: HELD in state.pools, RECOVERY)
    cluster.kubectl("delete", "tpusyncpool", "h", "-n", ns, "--timeout=90s", timeout=120)
    assert HELD not in state.pools


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


V7X_POOL = "e2e-gke-v7x"


def test_an_autoscaled_multi_host_pool_grows_a_serving_by_whole_slices(cluster, gke_operator, lws, module_namespace):
    """v7x 2x2x2 slices (2 hosts each) autoscaled between 2 and 6 hosts: the operator creates a
    node pool per slice through the API, the first kept up and the other two left to GKE's
    autoscaler between 0 and a whole slice. A serving scaled to three units (one multi-host decode
    replica each, its own slice: LWS's exclusive topology) fits without a capacity complaint; its
    new groups wait until the test, playing GKE's autoscaler, brings up whole slices; a fourth
    unit does not fit and the serving says so."""
    ns, state = module_namespace, gke_operator
    pool = gke_pool(ns, "v7", V7X_POOL, hosts=2)
    pool["spec"]["tpu"] = {"type": "v7x", "topology": "2x2x2"}
    pool["spec"]["capacity"] = {"autoscaling": {"minHosts": 2, "maxHosts": 6}}
    pool["spec"]["provisioning"]["gke"]["workloadPolicy"] = "e2e-v7x-policy"
    apply(cluster, pool)
    slices = [V7X_POOL, f"{V7X_POOL}-1", f"{V7X_POOL}-2"]
    wait_for("a node pool per slice", lambda: set(slices) <= set(state.pools), 90)
    assert [(state.pools[s]["initialNodeCount"], state.pools[s]["autoscaling"]["minNodeCount"],
             state.pools[s]["autoscaling"]["maxNodeCount"]) for s in slices] == [(2, 2, 2), (0, 0, 2), (0, 0, 2)]
    assert all(state.pools[s]["placementPolicy"] == {"type": "COMPACT", "policyName": "e2e-v7x-policy"}
               for s in slices)
    labels = state.pools[V7X_POOL]["config"]["labels"]

    def bring_up(node_pool: str) -> None:     # GKE's part: a whole slice of nodes with the pool's labels
        cluster.add_tpu_nodes(node_pool, 2, accelerator="tpu7x", topology="2x2x2", chips_per_node=4,
                              machine_type="tpu7x-standard-4t", labels=labels)
    bring_up(V7X_POOL)
    wait_condition(cluster, "tpusyncpool", ns, "v7", timeout=120)

    apply(cluster, serving_obj(ns, "v7", engine={"type": "vllm-tpu"}, pool="v7", prefill=0, decode=1,
                               routing={"enabled": False}))
    wait_condition(cluster, "disaggregatedservings", ns, "v7", timeout=120)
    cluster.kubectl("scale", "disaggregatedservings", "v7", "-n", ns, "--replicas=3")

    def waiting_for_slices():
        ds = get(cluster, "disaggregatedservings", ns, "v7")
        c = conditions(ds)
        pending = {p["metadata"]["name"] for p in cluster.kubectl_json(
            "get", "pods", "-n", ns, "-l", "tpusync.dev/serving=v7")["items"] if p["status"].get("phase") == "Pending"}
        # the new groups' leaders wait for nodes (LWS creates a group's workers once its leader runs)
        return (ds["status"]["decode"]["replicas"] == 3 and c["Degraded"]["status"] == "False"
                and pending == {"v7-decode-1", "v7-decode-2"} and ds)
    def state_now() -> str:
        pods = cluster.kubectl("get", "pods", "-n", ns, "-l", "tpusync.dev/serving=v7", "-o", "wide").stdout
        return f"\nstatus: {json.dumps(get(cluster, 'disaggregatedservings', ns, 'v7')['status'])}\n{pods}"
    ds = wait_for("two decode groups waiting for hosts", waiting_for_slices, 90, on_timeout=state_now)
    assert ds["status"]["decode"]["readyReplicas"] == 1
    bring_up(f"{V7X_POOL}-1")
    bring_up(f"{V7X_POOL}-2")
    ds = wait_condition(cluster, "disaggregatedservings", ns, "v7", timeout=120)
    assert ds["status"]["decode"] == {"kind": "LeaderWorkerSet", "replicas": 3, "readyReplicas": 3}
    nodes = {p["spec"]["nodeName"] for p in cluster.kubectl_json("get", "pods", "-n", ns, "-l",
                                                                 "tpusync.dev/serving=v7")["items"]}
    assert len(nodes) == 6                                   # each group a whole slice of its own

    cluster.kubectl("scale", "disaggregatedservings", "v7", "-n", ns, "--replicas=4")
    ds = wait_condition(cluster, "disaggregatedservings", ns, "v7", "Degraded", "True", reason="InsufficientCapacity")
    assert "need 8 TPU hosts" in conditions(ds)["Degraded"]["message"]
    cluster.kubectl("delete", "disaggregatedservings", "v7", "-n", ns, "--timeout=90s", timeout=120)
    cluster.kubectl("delete", "tpusyncpool", "v7", "-n", ns, "--timeout=120s", timeout=150)
    assert not set(slices) & set(state.pools)               # every slice's node pool deleted through the API
