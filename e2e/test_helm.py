"""The Helm chart on a real control plane: install, upgrade to a different shape, uninstall,
and after each step exactly the objects of the rendered release exist (no orphans).
kwok plays the operator pods, so `--wait` checks the Deployment rolls out. (The operator
itself, running with this chart's ServiceAccount and RBAC, is exercised in
test_operator.py.)"""

from __future__ import annotations

import yaml

from harness import REPO
from harness.operator_process import helm_install_operator
from harness.polling import wait_for

RELEASE = "e2e-helm"
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"
# Everything the chart can create (PodMonitoring/ServiceMonitor are off: no CRDs here),
# plus what the controllers derive from it.
KINDS = ("deployments.apps", "services", "serviceaccounts", "configmaps", "secrets",
         "roles.rbac.authorization.k8s.io", "rolebindings.rbac.authorization.k8s.io",
         "clusterroles.rbac.authorization.k8s.io",
         "clusterrolebindings.rbac.authorization.k8s.io", "kopfpeerings.kopf.dev",
         "clusterkopfpeerings.kopf.dev")
DERIVED = ("replicasets.apps", "pods")


def live(cluster, kinds=KINDS) -> set[tuple[str, str, str]]:
    out = cluster.kubectl_json("get", ",".join(kinds), "-A", "-l", INSTANCE)
    return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
            for o in out["items"]}


def rendered(cluster, namespace: str) -> set[tuple[str, str, str]]:
    manifest = cluster.helm("get", "manifest", RELEASE, "-n", namespace).stdout
    out = set()
    for doc in yaml.safe_load_all(manifest):
        if doc:
            out.add((doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]))
    return out


def assert_exactly_the_release(cluster, namespace: str) -> set:
    want = rendered(cluster, namespace)
    # Deletions of removed objects are synchronous in helm; poll only to be safe with caches.
    got = wait_for("live objects == rendered release",
                   lambda: (lambda g: g if g == want else None)(live(cluster)), 30,
                   on_timeout=lambda: f"\nextra: {live(cluster) - want}\nmissing: {want - live(cluster)}")
    return got


def test_install_upgrade_uninstall_leave_no_orphans(cluster, tpusync_crds, namespace):
    other = f"{namespace}-w"
    cluster.kubectl("create", "namespace", other)
    try:
        helm_install_operator(cluster, RELEASE, namespace, values={"peering": {"name": RELEASE}})
        got = assert_exactly_the_release(cluster, namespace)
        kinds = {k for k, _, _ in got}
        assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                "ClusterKopfPeering", "Service"} <= kinds, kinds
        dep = cluster.kubectl_json("get", "deployment", f"{RELEASE}-tpusync-operator",
                                   "-n", namespace)
        assert dep["status"]["availableReplicas"] == 2
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--peering={RELEASE}" in args and "--priority=auto" in args

        # Upgrade to a namespaced install with one replica and no metrics: the
        # ClusterKopfPeering and the metrics Service must go, a Role, RoleBinding and
        # KopfPeering appear in the watched namespace.
        cluster.helm("upgrade", RELEASE, str(REPO / "charts" / "tpusync-operator"), "-n", namespace, "--reuse-values",
                     "--set", f"watchNamespaces={{{other}}}", "--set", "replicas=1",
                     "--set", "metrics.enabled=false", "--wait", "--timeout", "120s")
        got = assert_exactly_the_release(cluster, namespace)
        assert ("ClusterKopfPeering", "", RELEASE) not in got
        assert ("Service", namespace, f"{RELEASE}-tpusync-operator-metrics") not in got
        assert {("Role", other, f"{RELEASE}-tpusync-operator"),
                ("RoleBinding", other, f"{RELEASE}-tpusync-operator"),
                ("KopfPeering", other, RELEASE)} <= got, got
        role = cluster.kubectl_json("get", "clusterrole", f"{RELEASE}-tpusync-operator")
        groups = {g for r in role["rules"] for g in r.get("apiGroups", [])}
        assert "apps" not in groups       # namespaced rules moved to the Role
        # The rollout leaves one pod (old ReplicaSet scaled to zero, kept as history).
        wait_for("one operator pod after the upgrade", lambda: len(cluster.kubectl_json(
            "get", "pods", "-n", namespace, "-l", INSTANCE)["items"]) == 1, 90)

        cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait", "--timeout", "120s")
        left = wait_for("nothing of the release left", lambda: (
            lambda g: None if g else "ok")(live(cluster, KINDS + DERIVED)), 90,
            on_timeout=lambda: f"\nleft: {live(cluster, KINDS + DERIVED)}")
        assert left == "ok"
        releases = cluster.kubectl_json("get", "secrets", "-n", namespace,
                                        "-l", f"owner=helm,name={RELEASE}")["items"]
        assert releases == []
        # CRDs are kept on uninstall (helm's policy for crds/): custom resources survive.
        assert cluster.kubectl("get", "crd", "tpusyncpools.tpusync.dev").returncode == 0
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
