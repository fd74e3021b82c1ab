"""The reconcilers when a request to the Kubernetes API fails (issue 14, item 13): a failed
get or list is not "nothing there". The pass stops, its status keeps every value observed
before, Ready and Progressing stay as they were (no NotReady event), Degraded names the
failed request, and the pass comes back soon. Once the API answers again, the status is
observed afresh."""

from __future__ import annotations

import asyncio
import copy

import kopf
import pytest
from op_helpers import FakeKube, PoolBody, ServingBody

from tpusync_operator.kube import KubeError
from tpusync_operator.reconcile import Deps
from tpusync_operator.reconcile_pool import reconcile_pool
from tpusync_operator.reconcile_serving import reconcile_serving

GiB = 2**30


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, body, type_, reason, message):
        self.events.append((type_, reason, message))


def deps(kube, clock):
    return Deps(kube=kube, now=clock, token=lambda: b"fixed-token", emit=Recorder())


def run(fn, kube, body, d):
    """One pass on the object as the API server holds it (status included)."""
    key = (body["apiVersion"], body["kind"], body["metadata"]["namespace"], body["metadata"]["name"])
    if key not in kube.objects:
        kube.put(body)
    current = copy.deepcopy(body)
    if "status" in kube.objects[key]:
        current["status"] = copy.deepcopy(kube.objects[key]["status"])
    return asyncio.run(fn(current, d))


def node(name):
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"cloud.google.com/gke-nodepool": "tpu-np"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def sidecar_pod(name, dram, disk):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "labels": {"tpusync.dev/pool": "pool"},
                         "annotations": {"tpusync.dev/dram-bytes": str(dram), "tpusync.dev/disk-bytes": str(disk)}},
            "status": {"initContainerStatuses": [{"name": "tpusync-sidecar", "ready": True}]}}


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def ready_pool(kube, clock):
    """A pool of 2 ready hosts whose 2 sidecars lend 16 GiB of DRAM and 100 GiB of disk each."""
    for i in range(2):
        kube.put(node(f"n{i}"))
        kube.put(sidecar_pod(f"p{i}", 16 * GiB, 100 * GiB))
    body = PoolBody().spec(capacity={"hosts": 2}).build()
    status = run(reconcile_pool, kube, body, deps(kube, clock))
    assert conds(status)["Ready"]["status"] == "True" and status["readyHosts"] == 2
    assert status["readySidecars"] == 2 and status["dramBytes"] == 32 * GiB
    return body, stored_status(kube, "TPUSyncPool")


def stored_status(kube, kind):
    """The status as the API server holds it (the merge patches applied: null fields gone)."""
    return copy.deepcopy(kube.find(kind, "pool" if kind == "TPUSyncPool" else "llm")["status"])


POOL_FAULTS = [
    (("list", "Pod"), KubeError(500, "etcdserver: request timed out", "GET /api/v1/namespaces/ns/pods"), "APIError"),
    (("list", "Node"), KubeError(0, "no answer within 30 s", "GET /api/v1/nodes"), "APIError"),
    (("get", "Secret"), KubeError(503, "unavailable", "GET /api/v1/namespaces/ns/secrets/pool-auth"), "APIError"),
    (("apply", "Service"), KubeError(500, "Internal error", "PATCH /api/v1/namespaces/ns/services/pool-peers"),
     "APIError"),
    (("list", "Pod"), KubeError(403, "pods is forbidden", "GET /api/v1/namespaces/ns/pods"), "ApplyFailed"),
]


@pytest.mark.parametrize("where,error,reason", POOL_FAULTS, ids=lambda v: str(v)[:40])
def test_a_failed_request_keeps_the_pool_status_as_last_observed(kube, clock, where, error, reason):
    body, before = ready_pool(kube, clock)
    clock.advance(60)
    kube.faults[where] = error
    d = deps(kube, clock)
    with pytest.raises(kopf.TemporaryError) as retry:
        run(reconcile_pool, kube, body, d)
    assert retry.value.delay == (60 if error.status == 403 else 10)
    after = kube.find("TPUSyncPool", "pool")["status"]
    # Every observed value as before: no fake zeros.
    for field in ("observedGeneration", "hosts", "readyHosts", "sidecars", "readySidecars", "dramBytes",
                  "diskBytes", "nodePool", "peersService"):
        assert after[field] == before[field], field
    # Ready and Progressing untouched (same lastTransitionTime); Degraded says what failed.
    assert conds(after)["Ready"] == conds(before)["Ready"]
    assert conds(after)["Progressing"] == conds(before)["Progressing"]
    degraded = conds(after)["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == reason
    assert error.request in degraded["message"] and str(error.status) in degraded["message"]
    assert degraded["lastTransitionTime"] == "2026-01-02T03:05:05Z"
    assert [e[:2] for e in d.emit.events] == [("Warning", reason)]          # no NotReady

    # The API answers again: observed afresh, Degraded clears, nothing else moved.
    del kube.faults[where]
    clock.advance(60)
    d = deps(kube, clock)
    run(reconcile_pool, kube, body, d)
    healed = stored_status(kube, "TPUSyncPool")
    assert conds(healed)["Degraded"]["status"] == "False"
    assert conds(healed)["Ready"] == conds(before)["Ready"]
    assert {k: v for k, v in healed.items() if k != "conditions"} == \
        {k: v for k, v in before.items() if k != "conditions"}
    assert d.emit.events == []


def test_a_failed_pass_from_a_body_older_than_the_last_status_write_holds_the_stored_status(kube, clock):
    """The watch event of the last status write can lag: a pass that starts from the body
    before it (no status yet) and then cannot observe holds the status the API server has,
    not the body's (which would erase every observed field and Ready with it)."""
    body, before = ready_pool(kube, clock)
    clock.advance(60)
    kube.faults[("list", "Pod")] = KubeError(500, "etcdserver: request timed out", "GET /api/v1/namespaces/ns/pods")
    d = deps(kube, clock)
    with pytest.raises(kopf.TemporaryError):
        asyncio.run(reconcile_pool(copy.deepcopy(body), d))      # the body as first created: no status
    after = stored_status(kube, "TPUSyncPool")
    for field in ("observedGeneration", "hosts", "readyHosts", "sidecars", "readySidecars", "dramBytes",
                  "diskBytes", "peersService"):
        assert after[field] == before[field], field
    assert conds(after)["Ready"] == conds(before)["Ready"]
    assert conds(after)["Degraded"]["reason"] == "APIError"
    assert [e[:2] for e in d.emit.events] == [("Warning", "APIError")]      # no Ready event again


def test_a_failed_observation_after_a_change_is_seen_as_not_yet_observed(kube, clock):
    """Changing the spec and failing to observe: the status stays that of the last generation
    observed, so nobody reads the old figures as the new spec's."""
    body, before = ready_pool(kube, clock)
    body["metadata"]["generation"] = 2
    body["spec"]["capacity"]["hosts"] = 4
    kube.put({**body, "status": before})
    kube.faults[("list", "Node")] = KubeError(500, "boom", "GET /api/v1/nodes")
    with pytest.raises(kopf.TemporaryError):
        run(reconcile_pool, kube, body, deps(kube, clock))
    after = kube.find("TPUSyncPool", "pool")["status"]
    assert after["observedGeneration"] == 1 and after["hosts"] == 2 and after["readyHosts"] == 2
    assert conds(after)["Ready"]["observedGeneration"] == 1
    assert conds(after)["Degraded"]["observedGeneration"] == 2


def test_a_first_pass_that_cannot_observe_reports_unknown_not_zero(kube, clock):
    kube.put(node("n0"))
    kube.faults[("list", "Pod")] = KubeError(500, "boom", "GET /api/v1/namespaces/ns/pods")
    d = deps(kube, clock)
    with pytest.raises(kopf.TemporaryError):
        run(reconcile_pool, kube, PoolBody().build(), d)
    status = kube.find("TPUSyncPool", "pool")["status"]
    assert not {"readyHosts", "readySidecars", "dramBytes"} & status.keys()   # unknown: null, so absent
    c = conds(status)
    assert c["Ready"]["status"] == "Unknown" and c["Ready"]["reason"] == "APIError"
    assert c["Progressing"]["status"] == "Unknown"
    assert c["Degraded"]["status"] == "True" and "GET /api/v1/namespaces/ns/pods" in c["Degraded"]["message"]
    assert [e[:2] for e in d.emit.events] == [("Normal", "SecretGenerated"), ("Warning", "APIError")]


def test_other_issues_are_still_reported_beside_the_failed_request(kube, clock):
    body, _ = ready_pool(kube, clock)
    body["spec"]["auth"] = {"secretName": "mine"}
    kube.faults[("list", "Pod")] = KubeError(500, "boom", "GET /api/v1/namespaces/ns/pods")
    with pytest.raises(kopf.TemporaryError):
        run(reconcile_pool, kube, body, deps(kube, clock))
    degraded = conds(kube.find("TPUSyncPool", "pool")["status"])["Degraded"]
    assert degraded["reason"] == "APIError"
    assert "GET /api/v1/namespaces/ns/pods" in degraded["message"] and "spec.auth.secretName" in degraded["message"]


# ---------------------------------------------------------------- serving

def ready_serving(kube, clock):
    kube.put(PoolBody().spec(capacity={"hosts": 3}).ready().build())
    body = ServingBody().spec(decode={"replicas": 2}).build()
    run(reconcile_serving, kube, body, deps(kube, clock))
    kube.find("Deployment", "llm-prefill")["status"] = {"readyReplicas": 1}
    kube.find("Deployment", "llm-decode")["status"] = {"readyReplicas": 2}
    kube.find("Deployment", "llm-epp")["status"] = {"availableReplicas": 1}
    status = run(reconcile_serving, kube, body, deps(kube, clock))
    assert conds(status)["Ready"]["status"] == "True" and status["routingReady"] is True
    assert status["decode"] == {"kind": "Deployment", "replicas": 2, "readyReplicas": 2}
    return body, stored_status(kube, "DisaggregatedServing")


SERVING_FAULTS = [
    (("get", "Deployment"), KubeError(500, "boom", "GET /apis/apps/v1/namespaces/ns/deployments/llm-prefill")),
    (("get", "TPUSyncPool"), KubeError(0, "ServerDisconnectedError: Server disconnected",
                                       "GET /apis/tpusync.dev/v1alpha1/namespaces/ns/tpusyncpools/pool")),
    (("served_kinds", None), KubeError(503, "unavailable", "GET /apis/inference.networking.k8s.io/v1")),
    (("apply", "Service"), KubeError(500, "boom", "PATCH /api/v1/namespaces/ns/services/llm-decode")),
]


@pytest.mark.parametrize("where,error", SERVING_FAULTS, ids=lambda v: str(v)[:40])
def test_a_failed_request_keeps_the_serving_status_as_last_observed(kube, clock, where, error):
    body, before = ready_serving(kube, clock)
    clock.advance(60)
    kube.faults[where] = error
    d = deps(kube, clock)
    with pytest.raises(kopf.TemporaryError):
        run(reconcile_serving, kube, body, d)
    after = kube.find("DisaggregatedServing", "llm")["status"]
    for field in ("observedGeneration", "prefill", "decode", "endpoint", "routingReady"):
        assert after[field] == before[field], field
    assert conds(after)["Ready"] == conds(before)["Ready"]
    assert conds(after)["Progressing"] == conds(before)["Progressing"]
    degraded = conds(after)["Degraded"]
    assert degraded["reason"] == "APIError" and error.request in degraded["message"]
    assert [e[:2] for e in d.emit.events] == [("Warning", "APIError")]

    del kube.faults[where]
    healed = run(reconcile_serving, kube, body, deps(kube, clock))
    assert {c: conds(healed)[c]["status"] for c in ("Ready", "Progressing", "Degraded")} == \
        {"Ready": "True", "Progressing": "False", "Degraded": "False"}
    assert healed["decode"] == before["decode"]


def test_a_failed_status_write_writes_nothing_else(clock):
    """When the status write itself fails, the pass fails (and is retried): no events."""
    kube = FakeKube()
    body, _ = ready_pool(kube, clock)
    kube.faults[("patch_status", "TPUSyncPool")] = KubeError(500, "boom")
    d = deps(kube, clock)
    with pytest.raises(KubeError):
        run(reconcile_pool, kube, body, d)
    assert d.emit.events == []
