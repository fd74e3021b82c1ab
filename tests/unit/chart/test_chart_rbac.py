"""RBAC of the chart: exactly the verbs and resources the operator uses (docs/operator.md,
"RBAC the operator needs"; operator/tpusync_operator/kube.py, reconcile.py, planner.py and
kopf's own calls), cluster-wide or per watched namespace."""

from __future__ import annotations

import pytest

from harness.helm import find, kinds
from tpusync_operator.builders.common import Owner
from tpusync_operator.builders.llmd import EPP_RULES, epp_leader_election_rules
from tpusync_operator.kube import RESOURCES
from tpusync_operator.serving_plan import OPTIONAL_KINDS


def rule(groups, resources, verbs):
    return {"apiGroups": groups, "resources": resources, "verbs": verbs}


# Cluster-scoped: kopf watches CRDs and discovers APIs (/api, /apis, /apis/<group>/<version>,
# also the operator's optional-CRD discovery); the pool's ready nodes are listed and watched.
CLUSTER_SCOPED = [
    rule(["apiextensions.k8s.io"], ["customresourcedefinitions"], ["list", "watch"]),
    rule([""], ["nodes"], ["list", "watch"]),
    {"nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*"], "verbs": ["get"]},
]
CLUSTER_PEERING = rule(["kopf.dev"], ["clusterkopfpeerings"], ["list", "watch", "patch"])
# kopf lists and watches namespaces only when it is limited to some (it falls back without).
NAMESPACES = rule([""], ["namespaces"], ["list", "watch"])
NAMESPACED_PEERING = rule(["kopf.dev"], ["kopfpeerings"], ["list", "watch", "patch"])
NAMESPACED = [
    rule(["tpusync.dev"], ["tpusyncpools", "disaggregatedservings"], ["get", "list", "watch", "patch"]),
    rule(["tpusync.dev"], ["tpusyncpools/status", "disaggregatedservings/status"], ["patch"]),
    rule([""], ["events"], ["create", "patch"]),
    rule([""], ["configmaps", "services", "serviceaccounts", "persistentvolumeclaims"],
         ["get", "list", "watch", "create", "patch", "delete"]),
    rule([""], ["secrets"], ["get", "create"]),
    rule([""], ["pods"], ["get", "list", "watch"]),
    rule(["apps"], ["deployments", "statefulsets", "daemonsets"],
         ["get", "list", "watch", "create", "patch", "delete"]),
    rule(["networking.k8s.io"], ["networkpolicies"], ["get", "list", "watch", "create", "patch", "delete"]),
    rule(["policy"], ["poddisruptionbudgets"], ["get", "list", "watch", "create", "patch", "delete"]),
    rule(["rbac.authorization.k8s.io"], ["roles", "rolebindings"],
         ["get", "list", "watch", "create", "patch", "delete"]),
    rule(["leaderworkerset.x-k8s.io"], ["leaderworkersets"], ["get", "list", "watch", "create", "patch", "delete"]),
    rule(["disaggregatedset.x-k8s.io"], ["disaggregatedsets"], ["get", "list", "watch", "create", "patch", "delete"]),
    rule(["inference.networking.k8s.io"], ["inferencepools"], ["get", "list", "watch", "create", "patch", "delete"]),
    rule(["llm-d.ai"], ["inferenceobjectives"], ["get", "list", "watch", "create", "patch", "delete"]),
    rule(["llm-d.ai", "inference.networking.x-k8s.io"], ["inferenceobjectives", "inferencemodelrewrites"],
         ["get", "list", "watch"]),
    rule(["coordination.k8s.io"], ["leases"], ["get", "create", "update"]),
    rule(["gateway.networking.k8s.io"], ["httproutes"], ["get", "list", "watch", "create", "patch", "delete"]),
    rule(["networking.gke.io"], ["healthcheckpolicies", "gcpbackendpolicies"],
         ["get", "list", "watch", "create", "patch", "delete"]),
]


def allows(rules, group: str, resource: str, verb: str) -> bool:
    return any(group in r.get("apiGroups", []) and resource in r.get("resources", []) and verb in r["verbs"]
               for r in rules)


def test_cluster_wide_rules_exactly(helm):
    objs = helm.template()
    assert find(objs, "ClusterRole")["rules"] == CLUSTER_SCOPED + [CLUSTER_PEERING] + NAMESPACED
    assert "Role" not in kinds(objs) and "RoleBinding" not in kinds(objs)
    binding = find(objs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "tpusync-tpusync-operator"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tpusync-tpusync-operator",
                                    "namespace": "tpusync-system"}]


def test_watch_namespaces_rules_exactly(helm):
    objs = helm.template({"watchNamespaces": ["team-a", "team-b"]})
    assert find(objs, "ClusterRole")["rules"] == CLUSTER_SCOPED + [NAMESPACES]
    for ns in ("team-a", "team-b"):
        assert find(objs, "Role", namespace=ns)["rules"] == [NAMESPACED_PEERING] + NAMESPACED
        rb = find(objs, "RoleBinding", namespace=ns)
        assert rb["roleRef"]["kind"] == "Role" and rb["roleRef"]["name"] == "tpusync-tpusync-operator"
        assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "tpusync-tpusync-operator",
                                   "namespace": "tpusync-system"}]
    assert kinds(objs).count("Role") == 2 and kinds(objs).count("RoleBinding") == 2


def test_standalone_holds_no_peering_rights(helm):
    objs = helm.template({"replicas": 1, "peering": {"enabled": False}})
    assert find(objs, "ClusterRole")["rules"] == CLUSTER_SCOPED + NAMESPACED
    objs = helm.template({"replicas": 1, "peering": {"enabled": False}, "watchNamespaces": ["a"]})
    assert find(objs, "Role", namespace="a")["rules"] == NAMESPACED


def test_rbac_off(helm):
    objs = helm.template({"rbac": {"create": False}})
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} & set(kinds(objs))


def test_no_wildcards_or_dangerous_verbs(helm):
    for values in ({}, {"watchNamespaces": ["a"]}):
        for o in helm.template(values):
            for r in o.get("rules", []):
                assert "*" not in r.get("apiGroups", []) + r.get("resources", []) + r["verbs"], r
                assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(r["verbs"]), r
                # update only where the EPP's Role grants it (its Lease); the operator applies.
                assert "update" not in r["verbs"] or r["resources"] == ["leases"], r
                # The operator never reads Secrets in bulk.
                if "secrets" in r.get("resources", []):
                    assert set(r["verbs"]) == {"get", "create"}


def test_every_kind_the_operator_touches_is_granted():
    """Each kind in kube.RESOURCES (what ApiKube can address) is granted somewhere."""
    rules = CLUSTER_SCOPED + NAMESPACED
    for (api_version, _kind), (plural, _namespaced) in RESOURCES.items():
        group = api_version.split("/")[0] if "/" in api_version else ""
        assert any(allows(rules, group, plural, v) for v in ("get", "list", "create", "patch")), plural


# Posted by the operator (events.py), never read: create only, least privilege.
POSTED_ONLY = {("v1", "Event")}


def test_every_namespaced_kind_can_be_read_by_name():
    """Each child is read before it is written, to write only the operator's own (ownership.py):
    every namespaced kind ApiKube addresses is granted get, but the events it posts."""
    for (api_version, kind), (plural, namespaced) in RESOURCES.items():
        group = api_version.split("/")[0] if "/" in api_version else ""
        if (api_version, kind) in POSTED_ONLY:
            assert not allows(NAMESPACED, group, plural, "get") and allows(NAMESPACED, group, plural, "create")
            continue
        assert not namespaced or allows(NAMESPACED, group, plural, "get"), plural


def test_every_optional_kind_the_planner_applies_is_granted():
    """Each optional kind (planner.OPTIONAL_KINDS: LWS, llm-d, Gateway and GKE Gateway kinds) is
    watched, read before it is written (ownership), applied and pruned by the operator."""
    for api_version, plural in OPTIONAL_KINDS.values():
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            assert allows(NAMESPACED, api_version.split("/")[0], plural, verb), (plural, verb)


@pytest.mark.parametrize("r", EPP_RULES + epp_leader_election_rules(
    Owner("tpusync.dev/v1alpha1", "DisaggregatedServing", "s", "ns", "u")),
                         ids=lambda r: ",".join(r["resources"] + r["verbs"]))
def test_operator_holds_what_the_epp_role_grants(r):
    """RBAC escalation prevention: the operator may only create the EPP Role (and bind it)
    if it holds every permission that Role grants."""
    for group in r["apiGroups"]:
        for resource in r["resources"]:
            for verb in r["verbs"]:
                assert allows(NAMESPACED, group, resource, verb), (group, resource, verb)
