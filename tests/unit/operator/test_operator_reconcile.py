"""The level-based reconcilers against an in-memory API server (FakeKube) and a fake GKE:
children applied with owner references, idempotence, drift repair, status written once per
pass with events after it, missing CRDs degrade, invalid specs are permanent errors."""

from __future__ import annotations

import asyncio
import base64
import copy

import kopf
import pytest
from op_helpers import FakeKube, PoolBody, ServingBody

from tpusync_operator.gke import GKEAuthError, GKETransientError
from tpusync_operator.kube import KubeError
from tpusync_operator.nodepools import delete_pool
from tpusync_operator.reconcile import Deps
from tpusync_operator.reconcile_pool import reconcile_pool
from tpusync_operator.reconcile_serving import reconcile_serving


def run(fn, body, d):
    """One reconcile pass; like the API server, the fake holds the object before it runs."""
    key = (body["apiVersion"], body["kind"], body["metadata"]["namespace"], body["metadata"]["name"])
    if key not in d.kube.objects:
        d.kube.put(body)
    return asyncio.run(fn(body, d))


class Recorder:
    def __init__(self, kube: FakeKube):
        self.kube = kube
        self.events = []

    def __call__(self, body, type_, reason, message):
        self.kube.log.append(("event", reason))
        self.events.append((type_, reason, message))


def deps(kube, clock, gke=None):
    return Deps(kube=kube, gke=gke, now=clock,
                token=lambda: b"fixed-token", emit=Recorder(kube))


def node(name, pool_label="tpu-np", ready=True):
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"cloud.google.com/gke-nodepool": pool_label}},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def stored(kube, body):
    """The body as the API server would return it next (status included)."""
    out = copy.deepcopy(body)
    obj = kube.objects.get((body["apiVersion"], body["kind"], "ns", body["metadata"]["name"]))
    if obj and "status" in obj:
        out["status"] = obj["status"]
    return out


def test_pool_existing_mode(kube, clock):
    kube.put(node("n1"))
    body = PoolBody().build()
    d = deps(kube, clock)
    status = run(reconcile_pool, body, d)
    assert ("Secret", "pool-auth") in kube.kinds() and ("ConfigMap", "pool-config") not in kube.kinds()
    assert ("Service", "pool-peers") in kube.kinds() and ("NetworkPolicy", "pool-data") in kube.kinds()
    for (_, kind, _, name), obj in kube.objects.items():
        if kind not in ("Node", "TPUSyncPool"):
            assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-pool", (kind, name)
    cond = {c["type"]: c for c in status["conditions"]}
    assert cond["Ready"]["status"] == "True" and cond["Ready"]["observedGeneration"] == 1
    assert status["readyHosts"] == 1 and status["nodePool"] == {"name": "tpu-np", "state": "Existing",
                                                                "operation": None}
    # one status write per pass, events only after it
    writes = [e for e in kube.log if e[0] == "status"]
    assert len(writes) == 1
    first_event = next(i for i, e in enumerate(kube.log) if e[0] == "event")
    assert first_event > kube.log.index(writes[0])
    assert ("Normal", "SecretGenerated", "generated auth Secret pool-auth") in d.emit.events


def test_pool_is_idempotent_and_repairs_drift(kube, clock):
    kube.put(node("n1"))
    body = PoolBody().build()
    run(reconcile_pool, body, deps(kube, clock))
    snapshot = copy.deepcopy(kube.objects)
    secret = kube.find("Secret", "pool-auth")["data"]
    clock.advance(60)
    kube.log.clear()
    d = deps(kube, clock)
    run(reconcile_pool, stored(kube, body), d)
    assert kube.objects == snapshot   # same children, same status (lastTransitionTime kept)
    assert not any(e[0] == "create" for e in kube.log) and d.emit.events == []
    assert kube.find("Secret", "pool-auth")["data"] == secret
    # drift: someone edits the peers Service; the next pass puts it back
    kube.find("Service", "pool-peers")["spec"]["publishNotReadyAddresses"] = False
    run(reconcile_pool, stored(kube, body), deps(kube, clock))
    assert kube.find("Service", "pool-peers")["spec"]["publishNotReadyAddresses"] is True


def test_pool_store_nodes_toggle_prunes(kube, clock):
    body = PoolBody().store(replicas=2).build()
    run(reconcile_pool, body, deps(kube, clock))
    assert kube.find("StatefulSet", "pool-store") is not None
    status = kube.find("TPUSyncPool", "pool")["status"]
    cond = {c["type"]: c for c in status["conditions"]}
    assert cond["Progressing"]["status"] == "True" and "store nodes" in cond["Progressing"]["message"]
    body["spec"]["storeNodes"]["enabled"] = False
    run(reconcile_pool, stored(kube, body), deps(kube, clock))
    assert kube.find("StatefulSet", "pool-store") is None


def store_pod(name, ready):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns",
                         "labels": {"tpusync.dev/pool": "pool", "app.kubernetes.io/component": "store"}},
            "status": {"containerStatuses": [{"name": "tpusync-sidecar", "ready": ready}]}}


def test_pool_is_ready_only_when_the_pods_it_counts_are(kube, clock):
    """The store's workload says its pod is ready while the pod list, read earlier, does not:
    Ready waits (it said "0 sidecars ready" before), and comes once both agree."""
    kube.put(node("n1"))
    body = PoolBody().store(replicas=1).build()
    run(reconcile_pool, body, deps(kube, clock))
    kube.find("StatefulSet", "pool-store")["status"] = {"readyReplicas": 1}
    kube.put(store_pod("pool-store-0", ready=False))
    status = run(reconcile_pool, stored(kube, body), deps(kube, clock))
    cond = {c["type"]: c for c in status["conditions"]}
    assert cond["Ready"]["status"] == "False" and "0/1 store nodes ready" in cond["Ready"]["message"]
    kube.put(store_pod("pool-store-0", ready=True))
    status = run(reconcile_pool, stored(kube, body), deps(kube, clock))
    cond = {c["type"]: c for c in status["conditions"]}
    assert cond["Ready"]["status"] == "True" and cond["Ready"]["message"] == "1 hosts, 1 sidecars ready"


def test_pool_missing_user_secret_is_degraded(kube, clock):
    body = PoolBody().spec(auth={"secretName": "mine"}).build()
    with pytest.raises(kopf.TemporaryError):
        run(reconcile_pool, body, deps(kube, clock))
    cond = {c["type"]: c for c in kube.find("TPUSyncPool", "pool")["status"]["conditions"]}
    assert cond["Degraded"]["reason"] == "AuthSecretMissing" and "spec.auth.secretName" in cond["Degraded"]["message"]
    assert kube.find("Secret", "pool-auth") is None


def test_invalid_pool_is_permanent(kube, clock):
    body = PoolBody().v7x("2x2x2").gke().build()   # v7x multi-host without a workload policy
    d = deps(kube, clock)
    with pytest.raises(kopf.PermanentError, match="workloadPolicy"):
        run(reconcile_pool, body, d)
    cond = {c["type"]: c for c in kube.find("TPUSyncPool", "pool")["status"]["conditions"]}
    assert cond["Degraded"]["reason"] == "InvalidSpec"
    assert d.emit.events[0][:2] == ("Warning", "InvalidSpec")
    assert not [k for k in kube.kinds() if k[0] != "TPUSyncPool"]


class FakeGKE:
    def __init__(self):
        self.pools = {}
        self.ops = {}
        self.calls = []
        self.fail = None

    def _check(self):
        if self.fail:
            raise self.fail

    async def get_operation(self, cluster, name):
        self._check()
        self.calls.append(("getop", name))
        return self.ops[name]

    async def get_node_pool(self, cluster, name):
        self._check()
        self.calls.append(("get", name))
        return self.pools.get(name)

    async def create_node_pool(self, cluster, request):
        self._check()
        np = request["nodePool"]
        self.calls.append(("create", np["name"]))
        self.pools[np["name"]] = {**np, "status": "PROVISIONING"}
        self.ops["op-1"] = {"name": "op-1", "status": "RUNNING"}
        return self.ops["op-1"]

    async def delete_node_pool(self, cluster, name):
        self._check()
        self.calls.append(("delete", name))
        if name not in self.pools:
            return None
        self.pools[name]["status"] = "STOPPING"
        return {"name": "op-2", "status": "RUNNING"}


def test_pool_gke_lifecycle(kube, clock):
    gke = FakeGKE()
    body = PoolBody().gke().build()
    d = deps(kube, clock, gke)
    with pytest.raises(kopf.TemporaryError):
        run(reconcile_pool, body, d)
    assert gke.calls == [("get", "pool"), ("create", "pool")]
    status = kube.find("TPUSyncPool", "pool")["status"]
    assert status["nodePool"] == {"name": "pool", "state": "CREATING", "operation": "op-1", "nodeCount": 1}
    assert ("Normal", "NodePoolCreating") in [e[:2] for e in d.emit.events]
    # operation still running: no second create
    with pytest.raises(kopf.TemporaryError):
        run(reconcile_pool, stored(kube, body), deps(kube, clock, gke))
    assert [c for c in gke.calls if c[0] == "create"] == [("create", "pool")]
    # GKE finishes; nodes appear
    gke.ops["op-1"]["status"] = "DONE"
    gke.pools["pool"]["status"] = "RUNNING"
    kube.put(node("n1", "pool"))
    status = run(reconcile_pool, stored(kube, body), deps(kube, clock, gke))
    assert status["nodePool"] == {"name": "pool", "state": "RUNNING", "operation": None, "nodeCount": 1}
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"


@pytest.mark.parametrize("error,reason,ready", [(GKEAuthError(403, "denied"), "GKEAuthFailed", "False"),
                                                (GKETransientError(503, "unavailable"), "GKEAPIError", "Unknown")])
def test_pool_gke_errors(kube, clock, error, reason, ready):
    gke = FakeGKE()
    gke.fail = error
    with pytest.raises(kopf.TemporaryError):
        run(reconcile_pool, PoolBody().gke().build(), deps(kube, clock, gke))
    cond = {c["type"]: c for c in kube.find("TPUSyncPool", "pool")["status"]["conditions"]}
    assert cond["Ready"]["status"] == ready      # a refusal blocks Ready; an outage leaves it unknown
    assert cond["Degraded"]["reason"] == reason and str(error.status) in cond["Degraded"]["message"]


def test_pool_gke_outage_keeps_ready_and_the_last_state(kube, clock):
    """GKE not answering (issue 14, item 13) is not the node pool failing: Ready and the state
    GKE last reported stay, Degraded says GKE did not answer, no NotReady event."""
    gke = FakeGKE()
    body = PoolBody().gke().build()
    with pytest.raises(kopf.TemporaryError):       # the operator creates the node pool
        run(reconcile_pool, body, deps(kube, clock, gke))
    gke.ops["op-1"]["status"], gke.pools["pool"]["status"] = "DONE", "RUNNING"
    kube.put(node("n1", "pool"))
    before = run(reconcile_pool, stored(kube, body), deps(kube, clock, gke))
    assert {c["type"]: c["status"] for c in before["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False"}, before["conditions"]
    gke.fail = GKETransientError(503, "unavailable")
    clock.advance(60)
    d = deps(kube, clock, gke)
    with pytest.raises(kopf.TemporaryError):
        run(reconcile_pool, stored(kube, body), d)
    after = kube.find("TPUSyncPool", "pool")["status"]
    cond = {c["type"]: c for c in after["conditions"]}
    assert cond["Ready"] == {c["type"]: c for c in before["conditions"]}["Ready"]
    assert cond["Degraded"]["reason"] == "GKEAPIError" and "node pool pool" in cond["Degraded"]["message"]
    assert after["nodePool"]["state"] == "RUNNING" and after["readyHosts"] == 1
    assert [e[:2] for e in d.emit.events] == [("Warning", "GKEAPIError")]
    gke.fail = None
    healed = run(reconcile_pool, stored(kube, body), deps(kube, clock, gke))
    assert {c["type"]: c["status"] for c in healed["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False"}


# The labels of a node pool the operator created for PoolBody's pool (builders.pool.node_pool_mark).
MARK = {"tpusync.dev/managed-by": "tpusync-operator", "tpusync.dev/owner-uid": "uid-pool"}


def test_pool_delete_waits_for_gke(kube, clock):
    gke = FakeGKE()
    gke.pools["pool"] = {"name": "pool", "status": "RUNNING", "config": {"labels": MARK}}
    body = PoolBody().gke().build()
    with pytest.raises(kopf.TemporaryError, match="deleted"):
        run(delete_pool, body, deps(kube, clock, gke))
    with pytest.raises(kopf.TemporaryError):
        run(delete_pool, body, deps(kube, clock, gke))
    assert [c for c in gke.calls if c[0] == "delete"] == [("delete", "pool")]   # STOPPING: not deleted twice
    del gke.pools["pool"]
    run(delete_pool, body, deps(kube, clock, gke))     # gone: the finalizer may be released


def test_delete_of_existing_pool_touches_no_cloud(kube, clock):
    """With a GKE client at hand (as the operator always has one), a pool in mode existing
    makes no call: the node pool is not the operator's to delete."""
    gke = FakeGKE()
    gke.pools["tpu-np"] = {"name": "tpu-np", "status": "RUNNING"}
    run(delete_pool, PoolBody().build(), deps(kube, clock, gke))
    assert gke.calls == [] and gke.pools["tpu-np"]["status"] == "RUNNING"
    run(delete_pool, PoolBody().gke().build(), deps(kube, clock, gke))     # a gke pool: asked about
    assert gke.calls == [("get", "pool")]


def test_children_are_applied_not_replaced(kube, clock):
    """Server-side apply, as the API server does it: a field another manager set on a child
    stays across passes; a field the operator applied is put back when edited."""
    kube.put(node("n1"))
    body = PoolBody().build()
    run(reconcile_pool, body, deps(kube, clock))
    svc = kube.find("Service", "pool-peers")
    svc["metadata"]["annotations"] = {"example.com/owner": "team-a"}      # e.g. `kubectl annotate`
    svc["spec"]["publishNotReadyAddresses"] = False
    run(reconcile_pool, stored(kube, body), deps(kube, clock))
    svc = kube.find("Service", "pool-peers")
    assert svc["metadata"]["annotations"] == {"example.com/owner": "team-a"}
    assert svc["spec"]["publishNotReadyAddresses"] is True


def test_fake_apply_drops_what_the_manager_stopped_applying(kube):
    """The fake's apply: fields this manager applied before and no longer applies go, others'
    fields stay (the API server's managedFields semantics, lists atomic)."""
    def cm(data):
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"}, "data": data}
    asyncio.run(kube.apply(cm({"a": "1", "b": "2"})))
    kube.find("ConfigMap", "c")["data"]["other"] = "kept"
    asyncio.run(kube.apply(cm({"a": "3"})))
    assert kube.find("ConfigMap", "c")["data"] == {"a": "3", "other": "kept"}


# ---------------------------------------------------------------- serving

def test_serving_full(kube, clock):
    kube.put(PoolBody().spec(capacity={"hosts": 2}).ready().build())
    body = ServingBody().spec(routing={"gatewayRef": {"name": "gw"}}).build()
    status = run(reconcile_serving, body, deps(kube, clock))
    kinds = {k for k, _ in kube.kinds()}
    assert {"Deployment", "Service", "InferencePool", "InferenceObjective", "HTTPRoute", "ConfigMap",
            "Role", "RoleBinding", "ServiceAccount", "NetworkPolicy"} <= kinds
    assert status["endpoint"] == "gateway/ns/gw" and status["routingReady"] is False
    assert status["prefill"] == {"kind": "Deployment", "replicas": 1, "readyReplicas": 0}
    # The /scale subresource's status side: units applied, and one engine pod per unit (the decode
    # pods here) for an autoscaler to measure.
    assert status["replicas"] == 1
    assert status["selector"] == "llm-d.ai/inference-serving=true,tpusync.dev/role=decode,tpusync.dev/serving=llm"
    # workloads become ready
    for name in ("llm-prefill", "llm-decode"):
        kube.find("Deployment", name)["status"] = {"readyReplicas": 1}
    kube.find("Deployment", "llm-epp")["status"] = {"availableReplicas": 1}
    d = deps(kube, clock)
    status = run(reconcile_serving, stored(kube, body), d)
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False", "KVPath": "Unknown"}
    assert ("Normal", "Ready") in [e[:2] for e in d.emit.events]


def revision_set(role, revision, replicas, ready, created):
    """A LeaderWorkerSet as the DisaggregatedSet controller makes it for one role of one revision."""
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": f"llm-{revision}-{role}", "namespace": "ns", "creationTimestamp": created,
                         "labels": {"disaggregatedset.x-k8s.io/name": "llm", "disaggregatedset.x-k8s.io/role": role,
                                    "disaggregatedset.x-k8s.io/revision": revision, "tpusync.dev/serving": "llm"}},
            "spec": {"replicas": replicas}, "status": {"readyReplicas": ready}}


def test_serving_lockstep_status_follows_the_sets_revisions(clock):
    kube = FakeKube(served={"LeaderWorkerSet", "DisaggregatedSet", "InferencePool", "InferenceObjective"})
    kube.put(PoolBody().spec(capacity={"hosts": 4}).ready().build())
    body = ServingBody().spec(rollout={"strategy": "Lockstep", "maxSurge": 1, "maxUnavailable": 0}).build()
    status = run(reconcile_serving, body, deps(kube, clock))
    assert kube.find("DisaggregatedSet", "llm") is not None and kube.find("Deployment", "llm-prefill") is None
    assert status["rollout"] == {"strategy": "Lockstep", "revision": None, "revisions": []}
    kube.find("Deployment", "llm-epp")["status"] = {"availableReplicas": 1}
    for role in ("prefill", "decode"):          # the controller's first revision, ready
        kube.put(revision_set(role, "aaaa1111", 1, 1, "2026-01-01T00:00:00Z"))
    status = run(reconcile_serving, stored(kube, body), deps(kube, clock))
    assert status["prefill"] == {"kind": "LeaderWorkerSet", "replicas": 1, "readyReplicas": 1}
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False", "KVPath": "Unknown"}
    for role in ("prefill", "decode"):          # a rollout: the new revision's surge is not ready yet
        kube.put(revision_set(role, "bbbb2222", 1, 0, "2026-01-02T00:00:00Z"))
    status = run(reconcile_serving, stored(kube, body), deps(kube, clock))
    assert status["rollout"]["revision"] == "bbbb2222"
    assert [r["revision"] for r in status["rollout"]["revisions"]] == ["bbbb2222", "aaaa1111"]
    assert status["rollout"]["revisions"][1]["decode"] == {"replicas": 1, "readyReplicas": 1}
    cond = {c["type"]: c for c in status["conditions"]}
    assert cond["Ready"]["status"] == "True" and cond["Progressing"]["reason"] == "LockstepRollout"
    assert status["prefill"]["readyReplicas"] == 0        # the newest revision's


def test_serving_missing_crds_degrades_not_crashes(clock):
    kube = FakeKube(served=set())
    kube.put(PoolBody().v7x("2x2x2").spec(capacity={"hosts": 4}).ready().build())   # two slices
    body = ServingBody().spec(engine={"type": "vllm-tpu"}).build()
    d = deps(kube, clock)
    with pytest.raises(kopf.TemporaryError, match="LeaderWorkerSet"):
        run(reconcile_serving, body, d)
    cond = {c["type"]: c for c in kube.find("DisaggregatedServing", "llm")["status"]["conditions"]}
    assert cond["Degraded"]["status"] == "True" and cond["Degraded"]["reason"] == "MissingCRD"
    assert "LeaderWorkerSet" in cond["Degraded"]["message"] and "InferencePool" in cond["Degraded"]["message"]
    assert ("Warning", "MissingCRD") in [e[:2] for e in d.emit.events]
    assert kube.find("LeaderWorkerSet", "llm-prefill") is None
    # the CRDs get installed: the next pass converges without a restart
    kube.served = {"LeaderWorkerSet", "InferencePool", "InferenceObjective"}
    run(reconcile_serving, stored(kube, body), deps(kube, clock))
    assert kube.find("LeaderWorkerSet", "llm-prefill") is not None and kube.find("InferencePool", "llm")
    cond = {c["type"]: c for c in kube.find("DisaggregatedServing", "llm")["status"]["conditions"]}
    assert cond["Degraded"]["status"] == "False"


def test_serving_pool_not_found(kube, clock):
    with pytest.raises(kopf.TemporaryError, match="TPUSyncPool pool not found"):
        run(reconcile_serving, ServingBody().build(), deps(kube, clock))
    cond = {c["type"]: c for c in kube.find("DisaggregatedServing", "llm")["status"]["conditions"]}
    assert cond["Degraded"]["reason"] == "PoolNotFound" and "spec.poolRef.name" in cond["Degraded"]["message"]


def test_serving_plan_error_is_permanent(kube, clock):
    kube.put(PoolBody().ready().build())
    with pytest.raises(kopf.PermanentError, match=r"spec\.prefill\.topology"):
        run(reconcile_serving, ServingBody().spec(prefill={"topology": "2x2"}).build(), deps(kube, clock))


def test_serving_invalid_spec_is_permanent(kube, clock):
    body = ServingBody().build()
    del body["spec"]["model"]
    with pytest.raises(kopf.PermanentError, match=r"spec\.model"):
        run(reconcile_serving, body, deps(kube, clock))


def test_routing_disabled_removes_llmd_objects(kube, clock):
    kube.put(PoolBody().ready().build())
    body = ServingBody().build()
    run(reconcile_serving, body, deps(kube, clock))
    assert kube.find("InferencePool", "llm") and kube.find("Deployment", "llm-epp")
    body["spec"]["routing"] = {"enabled": False}
    run(reconcile_serving, stored(kube, body), deps(kube, clock))
    assert kube.find("InferencePool", "llm") is None and kube.find("Deployment", "llm-epp") is None
    assert kube.find("Deployment", "llm-decode") is not None


def test_serving_larger_than_its_pool_is_degraded_and_still_applied(kube, clock):
    kube.put(PoolBody().v7x("2x2x2").gke(workloadPolicy="wp").ready().build())   # one slice
    d = deps(kube, clock)
    status = run(reconcile_serving, ServingBody().spec(engine={"type": "vllm-tpu"}).build(), d)
    cond = {c["type"]: c for c in status["conditions"]}
    assert cond["Degraded"]["status"] == "True" and cond["Degraded"]["reason"] == "InsufficientCapacity"
    assert "need 4 TPU hosts" in cond["Degraded"]["message"] and cond["Ready"]["status"] == "False"
    assert ("Warning", "InsufficientCapacity") in [e[:2] for e in d.emit.events]
    assert kube.find("LeaderWorkerSet", "llm-prefill") is not None   # what fits still runs


def test_transient_api_error_retries(kube, clock):
    kube.put(PoolBody().ready().build())
    kube.fail_next.append(KubeError(503, "etcd timeout"))
    with pytest.raises(kopf.TemporaryError, match="etcd timeout"):
        run(reconcile_serving, ServingBody().build(), deps(kube, clock))
    assert [e for e in kube.log if e[0] == "status"]   # status still written once


@pytest.mark.parametrize("sample", ["v6e-single-host-reference.yaml", "v7x-multi-host-vllm.yaml"])
def test_samples_reconcile(clock, sample):
    from op_helpers import load_samples
    kube = FakeKube()
    pool, serving = load_samples(sample)
    for doc in (pool, serving):
        doc["metadata"].update(uid="uid-" + doc["metadata"]["name"], generation=1)
    gke = FakeGKE()
    if pool["spec"]["provisioning"]["mode"] == "gke":
        with pytest.raises(kopf.TemporaryError):   # the node pool is being created
            run(reconcile_pool, pool, deps(kube, clock, gke))
        assert gke.calls[-1][0] == "create"
    else:
        run(reconcile_pool, pool, deps(kube, clock, gke))
        assert gke.calls == []
    status = run(reconcile_serving, serving, deps(kube, clock))
    assert kube.find("InferencePool", serving["metadata"]["name"]) is not None
    # Every replica fits the sample's pool: nothing degraded, only waiting for pods.
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert degraded["status"] == "False", degraded


def test_sglang_jax_pd_secret_is_generated_once_and_ready_waits_for_the_bootstrap(kube, clock):
    kube.put(PoolBody().spec(capacity={"hosts": 2}).ready().build())
    body = ServingBody().spec(engine={"type": "sglang-jax", "image": "r.example/sgl:main"},
                              kvTransfer={"connector": "sglang-jax"}, routing={"precisePrefixCache": False}).build()
    d = deps(kube, clock)
    run(reconcile_serving, body, d)
    secret = kube.find("Secret", "llm-pd-secret")
    value = base64.b64decode(secret["data"]["secret"]).decode()
    assert value == b"fixed-token".hex()             # the generated bytes, hex: sglang-jax wants a string
    assert secret["metadata"]["ownerReferences"][0]["name"] == "llm"
    assert ("Normal", "SecretGenerated") in [e[:2] for e in d.emit.events]
    for name in ("llm-prefill", "llm-decode"):
        kube.find("Deployment", name)["status"] = {"readyReplicas": 1}
    kube.find("Deployment", "llm-epp")["status"] = {"availableReplicas": 1}
    status = run(reconcile_serving, stored(kube, body), deps(kube, clock))
    assert kube.find("Secret", "llm-pd-secret")["data"] == secret["data"]     # never rotated
    ready = {c["type"]: c for c in status["conditions"]}
    assert ready["Ready"]["status"] == "False"
    assert "sglang-jax P/D bootstrap not ready" in ready["Progressing"]["message"]
    kube.find("Deployment", "llm-pd-bootstrap")["status"] = {"availableReplicas": 1}
    status = run(reconcile_serving, stored(kube, body), deps(kube, clock))
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
