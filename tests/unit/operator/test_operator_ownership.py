"""The operator touches only what it owns (issue 41). Children are addressed by name, so a
name a pool or serving wants may be held by an object it did not make: another team's, or
another tpusync object's child. Such an object is never applied over, created over or
deleted: the pass writes nothing, and the status names the object and the field that makes
the name. Stale children are deleted only where they are this object's. Against the
in-memory API server (FakeKube); e2e/test_operator_ownership.py holds the same on the real one."""

from __future__ import annotations

import asyncio
import copy

import kopf
import pytest
from op_helpers import PoolBody, ServingBody
from test_operator_reconcile import deps, node, run, stored

from tpusync_operator.builders.common import Owner
from tpusync_operator.kube import KubeError
from tpusync_operator.ownership import Conflict, conflict, conflict_message, owned
from tpusync_operator.reconcile_pool import reconcile_pool
from tpusync_operator.reconcile_serving import reconcile_serving

OWNER = Owner("tpusync.dev/v1alpha1", "TPUSyncPool", "pool", "ns", "uid-pool")
OURS = {"app.kubernetes.io/managed-by": "tpusync-operator", "app.kubernetes.io/instance": "pool"}


def foreign(api_version, kind, name, body=None, **meta):
    """Another team's object, as kubectl made it: no owner reference, its own labels."""
    obj = {"apiVersion": api_version, "kind": kind,
           "metadata": {"name": name, "namespace": "ns", "uid": f"uid-theirs-{kind}-{name}",
                        "labels": {"team": "other"},
                        "managedFields": [{"manager": "kubectl-client-side-apply", "operation": "Update"}], **meta}}
    obj.update(body or {"spec": {"theirs": True}})
    return obj


def controlled_by(kind, name, uid):
    return {"apiVersion": "tpusync.dev/v1alpha1", "kind": kind, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def writes(kube):
    return [e for e in kube.log if e[0] in ("apply", "create", "delete")]


# ------------------------------------------------------------------ pure rules

@pytest.mark.parametrize(("meta", "ours"), [
    ({"ownerReferences": [controlled_by("TPUSyncPool", "pool", "uid-pool")]}, True),
    # a child made before this change carries the same reference: still ours
    ({"ownerReferences": [controlled_by("TPUSyncPool", "pool", "uid-pool")], "labels": {}}, True),
    # another tpusync object's child, even one of the same name (an earlier object, being collected)
    ({"ownerReferences": [controlled_by("TPUSyncPool", "pool", "uid-earlier")], "labels": OURS}, False),
    ({"ownerReferences": [controlled_by("DisaggregatedServing", "s", "uid-s")]}, False),
    # no owner: another team's, unless it carries the operator's labels for this very object
    ({}, False),
    ({"labels": {"app.kubernetes.io/managed-by": "tpusync-operator", "app.kubernetes.io/instance": "other"}}, False),
    ({"labels": {"app.kubernetes.io/managed-by": "helm", "app.kubernetes.io/instance": "pool"}}, False),
    ({"labels": OURS}, True),        # orphaned by `kubectl delete --cascade=orphan` of an earlier `pool`: adopted
    ({"labels": OURS, "ownerReferences": [{"kind": "ConfigMap", "name": "x", "uid": "u"}]}, True),  # not a controller
])
def test_owned(meta, ours):
    assert owned(OWNER, {"metadata": {"name": "pool-peers", **meta}}) is ours


def test_conflict_names_the_object_its_holder_and_the_field():
    theirs = foreign("v1", "Service", "pool-peers")
    assert conflict(OWNER, theirs) == Conflict("Service", "ns", "pool-peers", "managed by kubectl-client-side-apply")
    assert conflict(OWNER, {**theirs, "metadata": {**theirs["metadata"], "ownerReferences": [controlled_by(
        "TPUSyncPool", "pool", "uid-earlier")]}}).holder == "owned by TPUSyncPool pool (uid uid-earlier)"
    assert conflict(OWNER, {"kind": "Service", "metadata": {"name": "x", "namespace": "ns"}}).holder == \
        "no owner reference"
    status_writer = {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status"}
    sts = foreign("apps/v1", "StatefulSet", "pool-store")
    sts["metadata"]["managedFields"].append(status_writer)
    assert conflict(OWNER, sts).holder == "managed by kubectl-client-side-apply"
    assert conflict(OWNER, {"kind": "Service", "metadata": {"name": "x", "labels": OURS}}) is None
    message = conflict_message(OWNER, [conflict(OWNER, theirs)])
    assert message.startswith("Service ns/pool-peers (managed by kubectl-client-side-apply) exists and is not "
                              "this TPUSyncPool's")
    assert "metadata.name" in message and "left as it is" in message


# ------------------------------------------------------------------ TPUSyncPool

def test_a_pool_leaves_objects_at_its_childrens_names_as_they_are(kube, clock):
    kube.put(node("n1"))
    theirs = [foreign("v1", "Service", "pool-peers"),
              foreign("networking.k8s.io/v1", "NetworkPolicy", "pool-data"),
              foreign("apps/v1", "StatefulSet", "pool-store"),
              foreign("v1", "Secret", "pool-auth", {"data": {"token": "dGhlaXJz"}})]
    for obj in theirs:
        kube.put(obj)
    body = PoolBody().store(replicas=1).build()
    d = deps(kube, clock)
    with pytest.raises(kopf.TemporaryError, match="NetworkPolicy ns/pool-data"):   # it comes back to look again
        run(reconcile_pool, body, d)
    for obj in theirs:
        assert kube.find(obj["kind"], obj["metadata"]["name"]) == obj, obj["kind"]
    assert writes(kube) == []          # nothing of the pool's applied either: the pass stopped
    c = conds(kube.find("TPUSyncPool", "pool")["status"])
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "NameConflict"
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "NameConflict"
    for text in ("Service ns/pool-peers", "NetworkPolicy ns/pool-data", "StatefulSet ns/pool-store",
                 "Secret ns/pool-auth", "managed by kubectl-client-side-apply", "metadata.name (pool)",
                 "spec.auth.secretName"):
        assert text in c["Degraded"]["message"], text
    # the Warning comes after the status write
    status_write = kube.log.index(("status", "TPUSyncPool", "pool"))
    assert ("Warning", "NameConflict") in [e[:2] for e in d.emit.events]
    assert kube.log.index(("event", "NameConflict")) > status_write

    # Their objects gone, the next pass makes the pool's own and the pool is Ready.
    for obj in theirs:
        asyncio.run(kube.delete(obj["apiVersion"], obj["kind"], "ns", obj["metadata"]["name"]))
    status = run(reconcile_pool, stored(kube, body), deps(kube, clock))
    assert conds(status)["Degraded"]["reason"] != "NameConflict"
    for kind, name in (("Service", "pool-peers"), ("NetworkPolicy", "pool-data"), ("StatefulSet", "pool-store"),
                       ("Secret", "pool-auth")):
        assert kube.find(kind, name)["metadata"]["ownerReferences"][0]["uid"] == "uid-pool"


def test_a_pool_deletes_no_stale_name_it_does_not_own(kube, clock):
    """<pool>-config (gone since an upgrade) and the store kind not in use are deleted each
    pass, but only where they are the pool's: another team's objects of those names stay, and
    do not stop the pool (it wants nothing at those names)."""
    kube.put(node("n1"))
    theirs = [foreign("v1", "ConfigMap", "pool-config", {"data": {"a": "b"}}),
              foreign("apps/v1", "DaemonSet", "pool-store")]
    for obj in theirs:
        kube.put(obj)
    body = PoolBody().store(replicas=1, kind="StatefulSet").build()
    run(reconcile_pool, body, deps(kube, clock))
    for obj in theirs:
        assert kube.find(obj["kind"], obj["metadata"]["name"]) == obj
    assert conds(kube.find("TPUSyncPool", "pool")["status"])["Degraded"]["status"] == "False"
    # The pool's own stale children still go: its StatefulSet when the store becomes a DaemonSet.
    assert kube.find("StatefulSet", "pool-store") is not None
    body["spec"]["storeNodes"]["kind"] = "DaemonSet"
    with pytest.raises(kopf.TemporaryError, match="DaemonSet ns/pool-store"):
        run(reconcile_pool, stored(kube, body), deps(kube, clock))    # now it wants their DaemonSet's name
    assert kube.find("StatefulSet", "pool-store") is not None   # and deletes nothing while it cannot proceed
    kube.objects.pop(("apps/v1", "DaemonSet", "ns", "pool-store"))
    run(reconcile_pool, stored(kube, body), deps(kube, clock))
    assert kube.find("StatefulSet", "pool-store") is None and kube.find("DaemonSet", "pool-store") is not None


def test_a_child_of_another_tpusync_object_is_not_ours(kube, clock):
    """Even with the operator's labels and this pool's name: a controller reference to another
    uid (an earlier pool of this name, its children not yet collected; or another object's)."""
    kube.put(node("n1"))
    earlier = foreign("v1", "Service", "pool-peers", labels=OURS,
                      ownerReferences=[controlled_by("TPUSyncPool", "pool", "uid-earlier")])
    kube.put(earlier)
    with pytest.raises(kopf.TemporaryError):
        run(reconcile_pool, PoolBody().build(), deps(kube, clock))
    assert kube.find("Service", "pool-peers") == earlier
    message = conds(kube.find("TPUSyncPool", "pool")["status"])["Degraded"]["message"]
    assert "owned by TPUSyncPool pool (uid uid-earlier)" in message


def test_children_made_before_an_upgrade_and_orphans_of_this_name_are_ours(kube, clock):
    kube.put(node("n1"))
    body = PoolBody().build()
    run(reconcile_pool, body, deps(kube, clock))
    # as an older operator left it: its reference, a label since dropped, another spec
    svc = kube.find("Service", "pool-peers")
    svc["metadata"]["labels"]["old"] = "label"
    svc["spec"]["publishNotReadyAddresses"] = False
    # orphaned by `kubectl delete tpusyncpool pool --cascade=orphan`: the references removed, labels kept
    kube.find("NetworkPolicy", "pool-data")["metadata"].pop("ownerReferences")
    kube.find("Secret", "pool-auth")["metadata"].pop("ownerReferences")
    secret = copy.deepcopy(kube.find("Secret", "pool-auth")["data"])
    status = run(reconcile_pool, stored(kube, body), deps(kube, clock))
    assert conds(status)["Ready"]["status"] == "True"
    assert kube.find("Service", "pool-peers")["spec"]["publishNotReadyAddresses"] is True
    assert kube.find("NetworkPolicy", "pool-data")["metadata"]["ownerReferences"][0]["uid"] == "uid-pool"
    assert kube.find("Secret", "pool-auth")["data"] == secret      # adopted, never rotated


def test_a_stale_child_replaced_after_it_was_read_is_not_deleted(kube, clock):
    """Deletes carry the uid the pass read: an object put at that name in between stays."""
    kube.put(node("n1"))
    body = PoolBody().store(replicas=1).build()
    run(reconcile_pool, body, deps(kube, clock))
    ours = kube.find("StatefulSet", "pool-store")
    ours["metadata"]["uid"] = "uid-ours-sts"
    theirs = foreign("apps/v1", "StatefulSet", "pool-store")
    get = kube.get

    async def get_then_replace(api_version, kind, namespace, name):
        obj = await get(api_version, kind, namespace, name)
        if kind == "StatefulSet" and obj is not None and obj["metadata"]["uid"] == "uid-ours-sts":
            kube.put(theirs)             # another team recreates the name right after the read
        return obj
    kube.get = get_then_replace
    body["spec"]["storeNodes"]["enabled"] = False
    with pytest.raises(kopf.TemporaryError, match="Kubernetes API 409"):
        run(reconcile_pool, stored(kube, body), deps(kube, clock))
    assert kube.find("StatefulSet", "pool-store") == theirs


def test_an_applied_child_replaced_after_it_was_read_is_not_applied_over(kube, clock):
    kube.put(node("n1"))
    body = PoolBody().build()
    run(reconcile_pool, body, deps(kube, clock))
    kube.find("Service", "pool-peers")["metadata"]["uid"] = "uid-ours-svc"
    theirs = foreign("v1", "Service", "pool-peers")
    get = kube.get

    async def get_then_replace(api_version, kind, namespace, name):
        obj = await get(api_version, kind, namespace, name)
        if kind == "Service" and obj is not None and obj["metadata"]["uid"] == "uid-ours-svc":
            kube.put(theirs)
        return obj
    kube.get = get_then_replace
    with pytest.raises(kopf.TemporaryError, match="Kubernetes API 422"):     # metadata.uid is immutable
        run(reconcile_pool, stored(kube, body), deps(kube, clock))
    assert kube.find("Service", "pool-peers") == theirs
    kube.get = get      # the next pass names it
    with pytest.raises(kopf.TemporaryError, match="Service ns/pool-peers"):
        run(reconcile_pool, stored(kube, body), deps(kube, clock))


# ------------------------------------------------------------ DisaggregatedServing

def test_a_serving_leaves_objects_at_its_childrens_names_as_they_are(kube, clock):
    kube.put(PoolBody().spec(capacity={"hosts": 2}).ready().build())
    theirs = [foreign("v1", "Service", "llm-prefill"),
              foreign("networking.k8s.io/v1", "NetworkPolicy", "llm-serving"),
              foreign("v1", "ConfigMap", "llm-epp", {"data": {"a": "b"}}),
              foreign("gateway.networking.k8s.io/v1", "HTTPRoute", "llm")]
    for obj in theirs:
        kube.put(obj)
    body = ServingBody().spec(routing={"gatewayRef": {"name": "gw"}}).build()
    d = deps(kube, clock)
    with pytest.raises(kopf.TemporaryError, match="HTTPRoute ns/llm"):
        run(reconcile_serving, body, d)
    for obj in theirs:
        assert kube.find(obj["kind"], obj["metadata"]["name"]) == obj, obj["kind"]
    assert writes(kube) == []
    c = conds(kube.find("DisaggregatedServing", "llm")["status"])
    assert c["Degraded"]["reason"] == "NameConflict" and c["Ready"]["reason"] == "NameConflict"
    assert c["Ready"]["status"] == "False"
    for text in ("Service ns/llm-prefill", "NetworkPolicy ns/llm-serving", "ConfigMap ns/llm-epp",
                 "HTTPRoute ns/llm", "metadata.name (llm)"):
        assert text in c["Degraded"]["message"], text
    assert ("Warning", "NameConflict") in [e[:2] for e in d.emit.events]

    for obj in theirs:
        kube.objects.pop((obj["apiVersion"], obj["kind"], "ns", obj["metadata"]["name"]))
    status = run(reconcile_serving, stored(kube, body), deps(kube, clock))
    assert conds(status)["Degraded"]["status"] == "False"
    assert kube.find("HTTPRoute", "llm")["metadata"]["ownerReferences"][0]["uid"] == "uid-llm"


def test_a_serving_deletes_no_stale_name_it_does_not_own(kube, clock):
    """Routing off: the endpoint picker's children are stale, and deleted only where they are
    the serving's; the LeaderWorkerSet of a role that runs as a Deployment likewise."""
    kube.put(PoolBody().spec(capacity={"hosts": 2}).ready().build())
    theirs = [foreign("apps/v1", "Deployment", "llm-epp"), foreign("v1", "ConfigMap", "llm-epp", {"data": {}}),
              foreign("policy/v1", "PodDisruptionBudget", "llm-epp"),
              foreign("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llm-prefill"),
              foreign("inference.networking.k8s.io/v1", "InferencePool", "llm")]
    for obj in theirs:
        kube.put(obj)
    status = run(reconcile_serving, ServingBody().spec(routing={"enabled": False}).build(), deps(kube, clock))
    for obj in theirs:
        assert kube.find(obj["kind"], obj["metadata"]["name"]) == obj, obj["kind"]
    assert conds(status)["Degraded"]["status"] == "False"
    assert not [e for e in kube.log if e[0] == "delete"]


def test_a_foreign_sglang_pd_secret_is_a_conflict(kube, clock):
    kube.put(PoolBody().spec(capacity={"hosts": 2}).ready().build())
    theirs = foreign("v1", "Secret", "llm-pd-secret", {"data": {"secret": "dGhlaXJz"}})
    kube.put(theirs)
    body = ServingBody().spec(engine={"type": "sglang-jax", "image": "r.example/sgl:main"},
                              kvTransfer={"connector": "sglang-jax"}, routing={"precisePrefixCache": False}).build()
    with pytest.raises(kopf.TemporaryError, match="Secret ns/llm-pd-secret"):
        run(reconcile_serving, body, deps(kube, clock))
    assert kube.find("Secret", "llm-pd-secret") == theirs and writes(kube) == []


# ------------------------------------------------------------------ the fake itself

def test_fake_honours_uid_preconditions(kube):
    svc = foreign("v1", "Service", "s")
    kube.put(svc)
    mine = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "ns", "uid": "other"}}
    with pytest.raises(KubeError) as e:
        asyncio.run(kube.apply(mine))
    assert e.value.status == 422
    with pytest.raises(KubeError) as e:
        asyncio.run(kube.delete("v1", "Service", "ns", "s", uid="other"))
    assert e.value.status == 409 and kube.find("Service", "s") == svc
    with pytest.raises(KubeError) as e:     # a uid names an object that exists: never a create
        asyncio.run(kube.apply({**mine, "metadata": {**mine["metadata"], "name": "absent"}}))
    assert e.value.status == 409 and kube.find("Service", "absent") is None
    assert asyncio.run(kube.delete("v1", "Service", "ns", "s", uid=svc["metadata"]["uid"]))
