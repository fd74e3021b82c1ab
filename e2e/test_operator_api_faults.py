"""The operator under API faults (issue 14, items 13 and 14), on the real control plane.

An operator process (the chart's ServiceAccount, RBAC enforced) reaches the API server
through the fault proxy (harness/faultproxy.py), which the tests command to answer chosen requests
with a 500 or to close their connections. The session's own operator is stopped meanwhile,
so this one alone reconciles, and restarted afterwards.

- A pass whose list of the pool's pods fails writes no fake zeros: readyHosts, sidecars and
  capacity stay as observed, Ready stays True (no NotReady event), Degraded names the failed
  request; once the API answers, Degraded clears and nothing else moved.
- A pass that must be retried touches its object; when that touch fails too (a 500, or its
  connection closed), it is tried again until written, and the retried pass runs.
- Every connection dropped for a while (watches included): afterwards the operator repairs
  a child deleted meanwhile, and the pool's status never showed zeros.
- A watch answered 404 (what the API server answers while a watched CRD is removed, or not
  established yet) does not stop the operator, as it stops kopf by default.
"""

from __future__ import annotations

import re

import pytest
from conftest import OPERATOR_NAMESPACE, OPERATOR_RELEASE, STORE_POOL
from test_operator import apply, conditions, get, pool_obj, wait_condition

from harness.faultproxy import FaultProxy
from harness.operator_process import OperatorProcess
from harness.polling import wait_for

RETRY_ANNOTATION = "tpusync.dev/retry"
OBSERVED = ("observedGeneration", "hosts", "readyHosts", "sidecars", "readySidecars", "dramBytes", "diskBytes")
GiB = 2**30


@pytest.fixture(scope="module")
def faulty(cluster, operator, tmp_path_factory):
    """(operator process talking through the proxy, the proxy). The session's operator is
    stopped while these tests run, and started again after them."""
    workdir = tmp_path_factory.mktemp("faulty-operator")
    proxy = FaultProxy(cluster.server, cluster.ca_file)
    proxy.start()
    direct = cluster.service_account_kubeconfig(OPERATOR_RELEASE, OPERATOR_NAMESPACE, workdir / "direct.kubeconfig")
    via_proxy = proxy.kubeconfig(direct, workdir / "proxy.kubeconfig")
    faulty_op = OperatorProcess(cluster, service_account=OPERATOR_RELEASE, namespace=OPERATOR_NAMESPACE,
                                workdir=workdir, peering=None,
                                extra_env={"KUBECONFIG": str(via_proxy), "POD_ID": "e2e-operator-faults"})
    operator.stop()
    try:
        faulty_op.start()
        yield faulty_op, proxy
    finally:
        try:
            faulty_op.stop()
            proxy.stop()
        finally:
            if not operator.alive():
                operator.start()


@pytest.fixture
def proxy(faulty):
    """The fault proxy, with no fault left behind by a test."""
    _, p = faulty
    p.clear()
    yield p
    p.clear()


def status_of(cluster, ns: str, name: str) -> dict:
    return (get(cluster, "tpusyncpool", ns, name) or {}).get("status") or {}


def poke(cluster, ns: str, pool: str, value: str) -> None:
    """An edit of the pool's NetworkPolicy: its watch event triggers a pass of the pool."""
    cluster.kubectl("label", "networkpolicy", f"{pool}-data", "-n", ns, f"e2e.tpusync.dev/poke={value}",
                    "--overwrite")


def pool_events(cluster, ns: str, name: str, reason: str) -> list[dict]:
    return [e for e in cluster.kubectl_json("get", "events", "-n", ns)["items"]
            if e["involvedObject"].get("name") == name and e["reason"] == reason]


def ready_pool(cluster, ns: str, name: str) -> dict:
    """A pool of the six e2e v6e hosts and one store node lending 32 GiB DRAM, 100 GiB disk."""
    apply(cluster, pool_obj(
        ns, name, tpu={"type": "v6e", "topology": "2x2"}, node_pool="e2e-v6e-2x2", hosts=6,
        store={"enabled": True, "kind": "StatefulSet", "replicas": 1, "dram": "32Gi", "disk": {"size": "100Gi"},
               "nodeSelector": {"cloud.google.com/gke-nodepool": STORE_POOL}}))
    pool = wait_condition(cluster, "tpusyncpool", ns, name)
    st = pool["status"]
    assert st["readyHosts"] == 6 and st["readySidecars"] == 1 and st["dramBytes"] == 32 * GiB, st
    assert conditions(pool)["Degraded"]["status"] == "False"
    return st


def test_a_failed_list_keeps_the_pool_status_as_last_observed(cluster, faulty, proxy, namespace):
    ns, name = namespace, "held"
    before = ready_pool(cluster, ns, name)
    pods = proxy.fail("GET", rf"/api/v1/namespaces/{ns}/pods", 500)      # the pass's list, not watches
    poke(cluster, ns, name, "1")
    wait_for("a pass to list the pool's pods through the fault", lambda: pods.hits >= 1, 60)
    after = wait_for("the pool's status written by the failed pass",
                     lambda: (s := status_of(cluster, ns, name)) != before and s, 60)

    for field in OBSERVED:                       # no fake zeros: what was observed before
        assert after[field] == before[field], (field, after)
    held = {c["type"]: c for c in after["conditions"]}
    was = {c["type"]: c for c in before["conditions"]}
    assert held["Ready"] == was["Ready"] and held["Progressing"] == was["Progressing"]
    degraded = held["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "APIError", degraded
    assert f"GET /api/v1/namespaces/{ns}/pods" in degraded["message"] and "500" in degraded["message"]
    wait_for("the APIError event", lambda: pool_events(cluster, ns, name, "APIError"), 30)

    proxy.clear()
    healed = wait_condition(cluster, "tpusyncpool", ns, name, type_="Degraded", status="False")["status"]
    for field in OBSERVED:
        assert healed[field] == before[field], (field, healed)
    assert {c["type"]: c for c in healed["conditions"]}["Ready"] == was["Ready"]
    assert not pool_events(cluster, ns, name, "NotReady")


@pytest.mark.parametrize("touch_fault", ["500", "connection closed"])
def test_a_retry_survives_its_own_failed_touches(cluster, faulty, proxy, namespace, touch_fault):
    """The pool selects no node (no pods, no node events): after the failed pass, only its
    retry (the touch) can bring a new pass."""
    ns, name = namespace, "retried"
    apply(cluster, pool_obj(ns, name, tpu={"type": "v6e", "topology": "2x2"},
                            node_pool="e2e-faults-no-such-pool", hosts=1))
    wait_condition(cluster, "tpusyncpool", ns, name, type_="Degraded", status="False")

    pods = proxy.fail("GET", rf"/api/v1/namespaces/{ns}/pods", 500)
    # The touch only: a patch of the object (not /status) that writes the retry annotation, not
    # kopf's own patches of its bookkeeping annotations.
    object_path = rf"/apis/tpusync.dev/v1alpha1/namespaces/{ns}/tpusyncpools/{name}"
    touch = (proxy.fail("PATCH", object_path, 500, body=re.escape(RETRY_ANNOTATION)) if touch_fault == "500"
             else proxy.reset("PATCH", object_path, body=re.escape(RETRY_ANNOTATION)))
    poke(cluster, ns, name, "1")
    wait_condition(cluster, "tpusyncpool", ns, name, type_="Degraded", status="True", reason="APIError")
    assert pods.hits >= 1
    # The pass asked to come back in 10 s; its touch fails, and must be tried again.
    wait_for("the failed touch to be tried again", lambda: touch.hits >= 2, 60)
    assert RETRY_ANNOTATION not in (get(cluster, "tpusyncpool", ns, name)["metadata"].get("annotations") or {})

    proxy.clear()
    pool = wait_condition(cluster, "tpusyncpool", ns, name, type_="Degraded", status="False", timeout=90)
    assert RETRY_ANNOTATION in pool["metadata"]["annotations"]          # the touch got through


def test_every_connection_dropped_for_a_while(cluster, faulty, proxy, namespace):
    """All connections closed, watches included, and refused for a while; a child deleted
    meanwhile is put back once the API server can be reached again."""
    op, _ = faulty
    ns, name = namespace, "outage"
    before = ready_pool(cluster, ns, name)
    proxy.drop_all()
    cluster.kubectl("delete", "networkpolicy", f"{name}-data", "-n", ns)       # directly, not through the proxy
    dropped = proxy.dropped
    wait_for("the operator to try again while dropped", lambda: proxy.dropped >= dropped + 10, 60)
    assert get(cluster, "networkpolicy", ns, f"{name}-data") is None
    proxy.restore()
    wait_for("the deleted NetworkPolicy put back", lambda: get(cluster, "networkpolicy", ns, f"{name}-data"), 120)
    after = wait_condition(cluster, "tpusyncpool", ns, name)["status"]
    for field in OBSERVED:
        assert after[field] == before[field], (field, after)
    assert op.alive()


def test_a_watch_answered_404_lists_again_and_the_operator_keeps_running(cluster, faulty, proxy, namespace):
    """Every watch reconnects and InferencePool's is answered 404 until cleared: the operator
    lists it again every few seconds (removed_crds.py) and goes on reconciling."""
    op, _ = faulty
    ns, name = namespace, "unserved"
    ready_pool(cluster, ns, name)
    unserved = proxy.fail("GET", r"/apis/inference\.networking\.k8s\.io/v1/(namespaces/[^/]+/)?inferencepools",
                          status=404, watch=True)
    proxy.drop_all()
    proxy.restore()
    wait_for("the InferencePool watch to be refused twice", lambda: unserved.hits >= 2, 60)
    assert op.alive()
    cluster.kubectl("delete", "networkpolicy", f"{name}-data", "-n", ns)
    wait_for("the deleted NetworkPolicy put back", lambda: get(cluster, "networkpolicy", ns, f"{name}-data"), 120)
    proxy.clear()
    assert op.alive() and "Traceback" not in op.log_text(), op.tail()
