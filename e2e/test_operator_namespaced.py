"""A namespace-scoped install (chart value watchNamespaces) on the real control plane: the
operator, as that install's ServiceAccount (RBAC enforced), reconciles the pools and servings
of the two namespaces it serves and never touches a third; and what its ServiceAccount may do,
asked of the API server (`kubectl auth can-i`, a SubjectAccessReview), is exactly that: nothing
outside its namespaces, no Secret it can list or watch anywhere, no RBAC escalation. The
cluster-wide install's ServiceAccount is held to the Secret and escalation rules too.

The session's cluster-wide operator is stopped while these tests run (it would reconcile the
third namespace) and started again after them.
"""

from __future__ import annotations

import pytest
from conftest import OPERATOR_NAMESPACE, OPERATOR_RELEASE, _new_namespace
from test_operator import apply, get, items, pool_obj, serving_obj, wait_condition

from harness.operator_process import OperatorProcess, helm_install_operator
from harness.polling import wait_for

RELEASE = "tpusync-scoped"
SYSTEM = "tpusync-scoped-system"
ACCOUNT = f"{RELEASE}-tpusync-operator"   # the chart's fullname for a release not named like it


@pytest.fixture(scope="module")
def scoped(cluster, operator, operator_nodes, tmp_path_factory):
    """(served namespaces, the namespace it does not serve, the scoped operator process)."""
    served = [_new_namespace(cluster, "team"), _new_namespace(cluster, "team")]
    other = _new_namespace(cluster, "other")
    helm_install_operator(cluster, RELEASE, SYSTEM, values={
        "watchNamespaces": served, "replicas": 1, "peering": {"name": RELEASE}})
    op = OperatorProcess(cluster, service_account=ACCOUNT, namespace=SYSTEM,
                         workdir=tmp_path_factory.mktemp("scoped-operator"), peering=RELEASE, namespaces=served)
    operator.stop()
    try:
        op.start()
        yield served, other, op
    finally:
        try:
            op.stop()
            cluster.helm("uninstall", RELEASE, "-n", SYSTEM, "--wait", "--timeout", "120s", check=False)
            for ns in [*served, other, SYSTEM]:
                cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        finally:
            if not operator.alive():
                operator.start()


def objects(ns: str) -> list[dict]:
    pool = pool_obj(ns, "kv", tpu={"type": "v6e", "topology": "2x2"}, node_pool="e2e-v6e-2x2", hosts=1)
    serving = serving_obj(ns, "ref", engine={"type": "reference", "cpuOnly": True}, pool="kv",
                          routing={"enabled": False})
    return [pool, serving]


def test_it_serves_its_namespaces_and_ignores_another(cluster, scoped):
    served, other, op = scoped
    for ns in [*served, other]:
        for obj in objects(ns):
            apply(cluster, obj)
    for ns in served:
        wait_condition(cluster, "tpusyncpool", ns, "kv", "Degraded", "False")
        wait_for(f"the serving's workloads in {ns}", lambda ns=ns: {d["metadata"]["name"] for d in items(
            cluster, "deployments", ns)} >= {"ref-prefill", "ref-decode"}, 90, interval=0.5)
        wait_for(f"the serving's status in {ns}", lambda ns=ns: (
            get(cluster, "disaggregatedserving", ns, "ref").get("status") or {}).get("conditions"), 60)
    # Every pass of the served namespaces has run; the other namespace's objects have not been
    # seen: no finalizer, no status, no child.
    for kind, name in (("tpusyncpool", "kv"), ("disaggregatedserving", "ref")):
        obj = get(cluster, kind, other, name)
        assert not obj.get("status") and not obj["metadata"].get("finalizers"), obj
    assert items(cluster, "deployments", other) == [] and items(cluster, "services", other) == []
    assert op.alive()


def can(cluster, account: str, verb: str, what: str, ns: str | None) -> bool:
    scope = ["-n", ns] if ns else ["--all-namespaces"]
    res = cluster.kubectl("auth", "can-i", verb, what, *scope, f"--as={account}", check=False)
    assert res.stdout.strip() in ("yes", "no"), res.stderr
    return res.stdout.strip() == "yes"


def test_its_service_account_can_do_nothing_outside_its_namespaces(cluster, scoped):
    served, other, _ = scoped
    sa = f"system:serviceaccount:{SYSTEM}:{ACCOUNT}"
    for ns in served:       # what it needs where it serves
        assert can(cluster, sa, "create", "deployments.apps", ns) and can(cluster, sa, "create", "roles", ns)
        assert can(cluster, sa, "create", "secrets", ns) and can(cluster, sa, "patch", "tpusyncpools/status", ns)
    for ns in (other, SYSTEM, "default"):
        for verb, what in (("get", "secrets"), ("create", "secrets"), ("create", "deployments.apps"),
                           ("create", "roles"), ("create", "rolebindings"), ("list", "pods"),
                           ("patch", "tpusyncpools"), ("create", "services")):
            assert not can(cluster, sa, verb, what, ns), f"{sa} may {verb} {what} in {ns}"
    for ns in [*served, other, None]:
        for verb in ("list", "watch"):
            assert not can(cluster, sa, verb, "secrets", ns), f"{sa} may {verb} secrets in {ns or 'all namespaces'}"
        for verb in ("escalate", "bind"):
            assert not can(cluster, sa, verb, "roles", ns) and not can(cluster, sa, verb, "clusterroles", ns)
    # Cluster-scoped: the reads it needs, nothing it could write.
    assert can(cluster, sa, "list", "nodes", None) and not can(cluster, sa, "patch", "nodes", None)
    assert not can(cluster, sa, "create", "clusterrolebindings", None)


def test_the_cluster_wide_install_reads_no_secret_it_did_not_name(cluster, scoped):
    """Cluster-wide, the operator may get and create Secrets by name (its generated auth Secret,
    and a pool's spec.auth.secretName), but list or watch none, and escalate nothing."""
    sa = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_RELEASE}"
    _, other, _ = scoped
    assert can(cluster, sa, "create", "secrets", other) and can(cluster, sa, "get", "secrets", other)
    for ns in (other, None):
        for verb in ("list", "watch", "update", "delete"):
            assert not can(cluster, sa, verb, "secrets", ns), f"{sa} may {verb} secrets in {ns or 'all namespaces'}"
        for verb in ("escalate", "bind"):
            assert not can(cluster, sa, verb, "roles", ns) and not can(cluster, sa, verb, "clusterroles", ns)
