"""The operator touches only what it owns (issue 41), on the real control plane, the operator
running as the chart's ServiceAccount (RBAC enforced).

Children are addressed by name. Another team's objects (made here with `kubectl create`: no
owner reference, not the operator's labels) at the names a TPUSyncPool's or a
DisaggregatedServing's children take are never applied over, created over or deleted: the
object's pass writes nothing, its status names them (`Degraded`/`NameConflict`) and the field
that makes the names, and each stays as it was, resourceVersion included where no controller of
its own writes its status. Once they are gone the object becomes Ready by itself. Their objects
at the names of stale children (which every pass deletes when they are the object's own) are
never deleted. ApiKube's writes carry the uid they checked, and the real API server refuses
them when the object was replaced.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from typing import Any

import pytest
from conftest import STORE_POOL
from kubernetes_asyncio import config
from test_operator import CONVERGE, apply, conditions, get, pool_obj, serving_obj, wait_condition

from harness.polling import wait_for
from tpusync_operator.kube import ApiKube, KubeError

THEIRS = {"app": "theirs"}
# A pass stopped by a conflict runs again after ownership.CONFLICT_RETRY_SECONDS (30 s): the
# recovery is seen within that and a pass's convergence.
RECOVERY = CONVERGE + 30


def theirs(kind: str, api_version: str, name: str, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind,
            "metadata": {"name": name, "namespace": ns, "labels": {"team": "theirs"},
                         "annotations": {"owner": "another team"}}, **body}


def service(name: str, ns: str) -> dict[str, Any]:
    """Headless, a named port: a shape the operator's apply of its own Service could take over."""
    return theirs("Service", "v1", name, ns, {"spec": {"clusterIP": "None", "selector": THEIRS,
                                                       "ports": [{"name": "theirs", "port": 80}]}})


def network_policy(name: str, ns: str) -> dict[str, Any]:
    return theirs("NetworkPolicy", "networking.k8s.io/v1", name, ns,
                  {"spec": {"podSelector": {"matchLabels": THEIRS}, "policyTypes": ["Ingress"]}})


def config_map(name: str, ns: str) -> dict[str, Any]:
    return theirs("ConfigMap", "v1", name, ns, {"data": {"theirs": "do not touch"}})


def workload(kind: str, name: str, ns: str) -> dict[str, Any]:
    """A StatefulSet (no replicas) or DaemonSet (on no node): no pod of theirs runs."""
    template = {"metadata": {"labels": THEIRS},
                "spec": {"nodeSelector": {"e2e.tpusync.dev/no-such-node": "true"},
                         "containers": [{"name": "theirs", "image": "registry.example/theirs:1"}]}}
    spec: dict[str, Any] = {"selector": {"matchLabels": THEIRS}, "template": template}
    if kind == "StatefulSet":
        spec |= {"replicas": 0, "serviceName": "theirs"}
    return theirs(kind, "apps/v1", name, ns, {"spec": spec})


def create(cluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("create", "-f", "-", input=json.dumps(obj))


def resource(obj: dict[str, Any]) -> str:
    """kubectl's name of obj's resource (kind.group)."""
    api_version = obj["apiVersion"]
    return obj["kind"].lower() + ("." + api_version.split("/")[0] if "/" in api_version else "")


def live(cluster, obj: dict[str, Any]) -> dict[str, Any] | None:
    return get(cluster, resource(obj), obj["metadata"]["namespace"], obj["metadata"]["name"])


def written_by_others_than_their_controllers(obj: dict[str, Any]) -> dict[str, Any]:
    """The object without what its own controller writes (status, and the status's entries in
    managedFields) and without resourceVersion, which those writes move: any write of ours
    (an apply adds the field manager tpusync-operator; a delete sets deletionTimestamp) shows."""
    out = copy.deepcopy(obj)
    out.pop("status", None)
    meta = out["metadata"]
    meta.pop("resourceVersion", None)
    meta["managedFields"] = [m for m in meta.get("managedFields", []) if m.get("subresource") != "status"]
    return out


def assert_as_they_were(cluster, before: dict[str, dict[str, Any]], exact: set[str]) -> None:
    """Each object still there, unchanged; those in `exact` (no controller writes their status)
    byte for byte, resourceVersion included."""
    for key, was in before.items():
        now = live(cluster, was)
        assert now is not None, f"{key} was deleted"
        if key in exact:
            assert now == was, key
        else:
            assert written_by_others_than_their_controllers(now) == written_by_others_than_their_controllers(was), key
        assert all(m["manager"] != "tpusync-operator" for m in now["metadata"].get("managedFields", [])), key


def key(obj: dict[str, Any]) -> str:
    return f"{obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']}"


def children_of(cluster, ns: str, owner: dict[str, Any], kinds: str) -> list[str]:
    return [f"{o['kind']}/{o['metadata']['name']}" for o in cluster.kubectl_json("get", kinds, "-n", ns)["items"]
            if any(r["uid"] == owner["metadata"]["uid"] for r in o["metadata"].get("ownerReferences", []))]


def first_status(cluster, resource_: str, ns: str, name: str) -> dict[str, Any]:
    """The object once a pass has written its status for the current generation."""
    def written() -> dict[str, Any] | None:
        obj = get(cluster, resource_, ns, name)
        ready = conditions(obj).get("Ready")
        return obj if ready and ready.get("observedGeneration") == obj["metadata"]["generation"] else None
    return wait_for(f"a status of {resource_} {ns}/{name}", written, CONVERGE)


def events(cluster, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in cluster.kubectl_json("get", "events", "-n", ns)["items"]
            if e["involvedObject"].get("name") == name and e["reason"] == reason]


def test_a_pool_leaves_another_teams_objects_as_they_are(cluster, operator, namespace):
    ns = namespace
    wanted = [service("kv-peers", ns), network_policy("kv-data", ns), workload("StatefulSet", "kv-store", ns),
              theirs("Secret", "v1", "kv-auth", ns, {"stringData": {"token": "theirs"}})]
    # Names every pass of the pool deletes when the objects are its own: <pool>-config (gone
    # since an upgrade) and the store's other kind.
    stale = [config_map("kv-config", ns), workload("DaemonSet", "kv-store", ns)]
    for obj in wanted + stale:
        create(cluster, obj)
    before = {key(o): live(cluster, o) for o in wanted + stale}
    exact = {key(o) for o in wanted + stale if o["kind"] not in ("StatefulSet", "DaemonSet")}   # no status writer

    apply(cluster, pool_obj(ns, "kv", tpu={"type": "v6e", "topology": "2x2"}, node_pool="e2e-v6e-2x2", hosts=1,
                            store={"enabled": True, "kind": "StatefulSet", "replicas": 1, "dram": "1Gi",
                                   "disk": {"size": "1Gi"},
                                   "nodeSelector": {"cloud.google.com/gke-nodepool": STORE_POOL}}))
    pool = first_status(cluster, "tpusyncpool", ns, "kv")
    assert_as_they_were(cluster, before, exact)
    c = conditions(pool)
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "NameConflict", c
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "NameConflict", c
    message = c["Degraded"]["message"]
    for obj in wanted:
        assert f"{key(obj)} (managed by kubectl-create)" in message, (key(obj), message)
    assert "metadata.name (kv)" in message and "spec.auth.secretName" in message, message
    assert f"ConfigMap {ns}/kv-config" not in message and "DaemonSet" not in message   # stale names stop nothing
    wait_for("the NameConflict event", lambda: events(cluster, ns, "kv", "NameConflict"), 30)
    assert children_of(cluster, ns, pool, "services,networkpolicies,statefulsets,daemonsets,configmaps") == []

    # The pass comes back by itself (kopf logs each pass that asks to): theirs are still left
    # as they were after it ran again.
    marker = f"failed temporarily: {message.split(';')[0]}"
    first = wait_for("the pass's retry in the log", lambda: operator.log_text().count(marker), 30)
    wait_for("the pool's pass to run again", lambda: operator.log_text().count(marker) > first, RECOVERY)
    assert_as_they_were(cluster, before, exact)

    # Theirs at the wanted names gone, the pool makes its own and is Ready, on its own.
    for obj in wanted:
        cluster.kubectl("delete", resource(obj), obj["metadata"]["name"], "-n", ns, "--wait=true")
    pool = wait_condition(cluster, "tpusyncpool", ns, "kv", timeout=RECOVERY)
    assert conditions(pool)["Degraded"]["status"] == "False"
    assert sorted(children_of(cluster, ns, pool, "services,networkpolicies,statefulsets")) == [
        "NetworkPolicy/kv-data", "Service/kv-peers", "StatefulSet/kv-store"]
    secret = get(cluster, "secret", ns, "kv-auth")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    # Its passes ran to their end (Ready), deleting its stale children: theirs are still there.
    assert_as_they_were(cluster, {key(o): before[key(o)] for o in stale}, exact)


def test_a_serving_leaves_another_teams_objects_as_they_are(cluster, operator, namespace):
    ns = namespace
    apply(cluster, pool_obj(ns, "kv", tpu={"type": "v6e", "topology": "2x2"}, node_pool="e2e-v6e-2x2", hosts=1))
    wait_condition(cluster, "tpusyncpool", ns, "kv")
    route = theirs("HTTPRoute", "gateway.networking.k8s.io/v1", "s", ns, {"spec": {
        "parentRefs": [{"name": "their-gateway"}],
        "rules": [{"backendRefs": [{"name": "their-service", "port": 80}]}]}})
    wanted = [service("s-prefill", ns), network_policy("s-serving", ns), config_map("s-epp", ns), route]
    # The endpoint picker's disruption budget is deleted by every pass when it is the serving's
    # own (spec.routing.eppHighAvailability is not ActiveActive).
    budget = theirs("PodDisruptionBudget", "policy/v1", "s-epp", ns,
                    {"spec": {"selector": {"matchLabels": THEIRS}, "minAvailable": 1}})
    for obj in [*wanted, budget]:
        create(cluster, obj)
    before = {key(o): live(cluster, o) for o in [*wanted, budget]}
    exact = {key(o) for o in wanted}

    apply(cluster, serving_obj(ns, "s", engine={"type": "reference"}, pool="kv", prefill=1, decode=0,
                               routing={"gatewayRef": {"name": "inference-gw"}}))
    serving = first_status(cluster, "disaggregatedserving", ns, "s")
    assert_as_they_were(cluster, before, exact)
    c = conditions(serving)
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "NameConflict", c
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "NameConflict", c
    for obj in wanted:
        assert f"{key(obj)} (managed by kubectl-create)" in c["Degraded"]["message"], key(obj)
    assert "metadata.name (s)" in c["Degraded"]["message"]
    wait_for("the NameConflict event", lambda: events(cluster, ns, "s", "NameConflict"), 30)
    assert children_of(cluster, ns, serving, "deployments,services,configmaps,networkpolicies,httproutes,"
                                             "inferencepools,serviceaccounts,roles,rolebindings") == []

    for obj in wanted:
        cluster.kubectl("delete", resource(obj), obj["metadata"]["name"], "-n", ns, "--wait=true")
    serving = wait_condition(cluster, "disaggregatedserving", ns, "s", timeout=RECOVERY)
    assert conditions(serving)["Degraded"]["status"] == "False"
    route_now = get(cluster, "httproute.gateway.networking.k8s.io", ns, "s")
    assert route_now["metadata"]["ownerReferences"][0]["uid"] == serving["metadata"]["uid"]
    assert route_now["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    assert_as_they_were(cluster, {key(budget): before[key(budget)]}, set())     # its stale name: left alone


def test_writes_carry_the_uid_they_checked(cluster, namespace):
    """ApiKube's patch with metadata.uid and delete with preconditions.uid, on the real API
    server: refused when the object at that name is another (a patch: 422, metadata.uid is
    immutable; a delete: 409) or absent (409: the patch creates nothing)."""
    ns = namespace

    async def go() -> None:
        api = await config.new_client_from_config(config_file=str(cluster.kubeconfig))
        kube = ApiKube(api)
        try:
            cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": ns},
                  "data": {"k": "theirs"}}
            create(cluster, cm)
            was = await kube.get("v1", "ConfigMap", ns, "c")
            assert was is not None
            other = str(uuid.uuid4())
            mine = {**cm, "data": {"k": "ours"}}
            for name, status in (("c", 422), ("absent", 409)):
                with pytest.raises(KubeError) as e:
                    await kube.apply({**mine, "metadata": {**mine["metadata"], "name": name, "uid": other}})
                assert e.value.status == status, e.value
            assert await kube.get("v1", "ConfigMap", ns, "c") == was
            assert await kube.get("v1", "ConfigMap", ns, "absent") is None
            with pytest.raises(KubeError) as e:
                await kube.delete("v1", "ConfigMap", ns, "c", uid=other)
            assert e.value.status == 409 and await kube.get("v1", "ConfigMap", ns, "c") == was
            uid = was["metadata"]["uid"]
            applied = await kube.apply({**mine, "metadata": {**mine["metadata"], "uid": uid}})
            assert applied["data"] == {"k": "ours"} and applied["metadata"]["uid"] == uid
            ours = [m for m in applied["metadata"]["managedFields"] if m["manager"] == "tpusync-operator"]
            assert [m["operation"] for m in ours] == ["Apply"] and "f:uid" not in json.dumps(ours)
            assert await kube.delete("v1", "ConfigMap", ns, "c", uid=uid)
            assert await kube.get("v1", "ConfigMap", ns, "c") is None
        finally:
            await api.close()
    asyncio.run(go())
