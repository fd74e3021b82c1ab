"""Issue 43: every setting works or is refused, naming it. Names the children cannot derive
their own from, replica bounds that serve nothing (or that LWS or sglang-jax refuse), queued
provisioning, partial multi-host slices in mode existing, routing settings that do nothing, a
shared tier's size and capacity beyond its claim, llm-d's block size against the engines' page
sizes; and the pool's data-port encryption, which works. The schema's refusals are in the corpus
(harness/invalid_objects.py) that the real API server (e2e/test_crds.py) and `validate` are held
to; the planner refuses the same objects (those stored before a rule existed reach it)."""

from __future__ import annotations

import asyncio
import typing

import kopf
import pytest
from op_helpers import PoolBody, ServingBody

from tpusync_operator import versions
from tpusync_operator.builders import names
from tpusync_operator.builders.common import Owner
from tpusync_operator.builders.serving import PoolInfo
from tpusync_operator.models import DisaggregatedServingSpec, ProxyKVConnector, TPUSyncPoolSpec
from tpusync_operator.pool_plan import SHARED_CAPACITY_BEYOND_CLAIM, PlanError, check_pool, shared_claim_problem
from tpusync_operator.reconcile_pool import reconcile_pool
from tpusync_operator.render import check, render
from tpusync_operator.serving_plan import OPTIONAL_KINDS, REFERENCE_PAGE_SIZE, plan_serving
from tpusync_operator.validate import validate

SGLANG = {"engine": {"type": "sglang-jax", "image": "r.example/sgl:main"}, "kvTransfer": {"connector": "sglang-jax"},
          "routing": {"precisePrefixCache": False}}
LOCKSTEP = {"rollout": {"strategy": "Lockstep"}}


def plan(serving: ServingBody, pool: PoolBody | None = None):
    pool_body = (pool or PoolBody()).build()
    spec = TPUSyncPoolSpec.model_validate(pool_body["spec"])
    info = PoolInfo(pool_body["metadata"]["name"], spec, check_pool(spec))
    body = serving.build()
    return plan_serving(Owner.from_body(body), DisaggregatedServingSpec.model_validate(body["spec"]), info,
                        set(OPTIONAL_KINDS))


def schema_errors(body: dict) -> list[str]:
    return [str(e) for e in validate(body)[1]]


# ------------------------------------------------------------------ names

def test_the_name_limits_are_the_children_suffixes_within_kubernetes_limits():
    assert (names.LABEL_MAX, names.STATEFULSET_MAX) == (63, 52)
    assert names.serving_name_max() == 63 - len("-prefill")
    assert names.serving_name_max(sglang=True) == 63 - len("-pd-bootstrap")
    assert names.serving_name_max(multi_host=True) == 52 - len("-prefill") - len("-99")
    assert names.serving_name_max(lockstep=True) == 52 - len("-12345678-prefill-99")
    assert names.serving_name_max(sglang=True, multi_host=True, lockstep=True) == 32
    assert names.pool_name_max(store_statefulset=False) == 63 - len("-peers")
    assert names.pool_name_max(store_statefulset=True) == 52 - len("-store")


SERVINGS = {   # (serving spec patch, pool, the name limit that applies)
    "single-host": ({}, PoolBody(), names.serving_name_max()),
    "sglang-jax": (SGLANG, PoolBody(), names.serving_name_max(sglang=True)),
    "multi-host": ({"engine": {"type": "vllm-tpu"}, "decode": {"hostsPerReplica": 2}},
                   PoolBody().v7x("2x2x2").gke(workloadPolicy="wp"), names.serving_name_max(multi_host=True)),
    "lockstep": (LOCKSTEP, PoolBody(), names.serving_name_max(lockstep=True)),
}


@pytest.mark.parametrize("case", sorted(SERVINGS))
def test_a_serving_named_at_its_limit_renders_children_kubernetes_admits_and_one_more_is_refused(case):
    patch, pool, limit = SERVINGS[case]
    at_limit = ServingBody(name="s" * limit).spec(**patch).build()
    assert check([pool.build(), at_limit]) == []
    for obj in render([pool.build(), at_limit]):
        kind, name = obj.body.get("kind"), obj.body.get("metadata", {}).get("name", "")
        if kind == "Service":
            assert len(name) <= names.LABEL_MAX, name
        if kind == "LeaderWorkerSet":       # its StatefulSets: <lws> and <lws>-<group>
            assert len(name + names.GROUP_INDEX) <= names.STATEFULSET_MAX, name
        if kind == "DisaggregatedSet":      # its LeaderWorkerSets' StatefulSets: <set>-<revision>-<role>-<group>
            assert len(name + names.REVISION + "-prefill" + names.GROUP_INDEX) <= names.STATEFULSET_MAX, name
    too_long = ServingBody(name="s" * (limit + 1)).spec(**patch).build()
    errors = check([pool.build(), too_long])
    assert any("metadata.name must be a DNS-1035 label" in e for e in errors), errors


def test_a_role_multi_host_by_its_pool_alone_is_refused_by_the_planner_naming_metadata_name():
    """The schema sees hostsPerReplica only; the pool's topology makes a role multi-host too."""
    pool = PoolBody().v7x("2x2x2").gke(workloadPolicy="wp")
    serving = ServingBody(name="s" * (names.serving_name_max(multi_host=True) + 1)).spec(engine={"type": "vllm-tpu"})
    assert schema_errors(serving.build()) == []
    errors = check([pool.build(), serving.build()])
    assert any("metadata.name: at most 41 characters with multi-host roles" in e for e in errors), errors
    with pytest.raises(PlanError, match=r"metadata\.name: at most 41"):
        plan(serving, pool)


@pytest.mark.parametrize("store,limit", [({}, 57), ({"enabled": True}, 46),
                                         ({"enabled": True, "kind": "DaemonSet"}, 57)])
def test_a_pool_named_at_its_limit_is_accepted_and_one_more_refused(store, limit):
    ok = PoolBody(name="p" * limit).spec(storeNodes=store).build()
    assert check([ok]) == []
    peers = [o.body for o in render([ok]) if o.body["kind"] == "Service"]
    assert peers and all(len(s["metadata"]["name"]) <= names.LABEL_MAX for s in peers)
    errors = check([PoolBody(name="p" * (limit + 1)).spec(storeNodes=store).build()])
    assert any("metadata.name must be a DNS-1035 label" in e for e in errors), errors


def test_names_children_cannot_take_are_refused():
    for name in ("1pool", "pool.a"):
        assert any("metadata.name must be a DNS-1035 label" in e for e in schema_errors(PoolBody(name=name).build()))
        assert any("metadata.name must be a DNS-1035 label" in e
                   for e in schema_errors(ServingBody(name=name).build()))


# ------------------------------------------------------------------ replica bounds

REFUSED_BOUNDS = [   # (serving spec patch, text of the refusal: CEL and planner alike)
    ({"decode": {"maxReplicas": 0}}, "spec.decode.maxReplicas: 0 with spec.decode.replicas above 0"),
    ({"prefill": {"maxReplicas": 0}, "decode": {"replicas": 0}}, "leave no replica of either role"),
    ({"prefill": {"replicas": 0}, "decode": {"replicas": 1, "minReplicas": 0, "maxReplicas": 0}},
     "spec.decode.maxReplicas: 0"),
    ({**LOCKSTEP, "replicas": 0, "prefill": {"minReplicas": 1}}, "Lockstep runs every role or none"),
    ({**LOCKSTEP, "decode": {"minReplicas": 2}}, "Lockstep runs every role or none"),
    ({**LOCKSTEP, "prefill": {"maxReplicas": 0}}, "Lockstep runs every role or none"),
    ({**SGLANG, "replicas": 2}, "at most one prefill replica with spec.engine.type sglang-jax"),
    ({**SGLANG, "prefill": {"replicas": 2}}, "at most one prefill replica with spec.engine.type sglang-jax"),
    ({**SGLANG, "replicas": 0, "prefill": {"minReplicas": 2}}, "at most one prefill replica"),
    ({"routing": {"proxyKvConnector": "sglang"}}, "spec.routing.proxyKvConnector: sglang is the P/D protocol"),
    ({**SGLANG, "routing": {"precisePrefixCache": False, "proxyKvConnector": "nixlv2"}},
     "spec.routing.proxyKvConnector: sglang is the P/D protocol"),
]
ACCEPTED_BOUNDS = [
    {"decode": {"replicas": 0, "maxReplicas": 0}},                  # prefill only: its Service is the endpoint
    {"prefill": {"maxReplicas": 0}},                                # decode only
    {"replicas": 0},                                                # scaled to zero
    {**LOCKSTEP, "replicas": 0},
    {**LOCKSTEP, "replicas": 0, "prefill": {"minReplicas": 1}, "decode": {"minReplicas": 1}},
    {**LOCKSTEP, "replicas": 3, "prefill": {"maxReplicas": 1}},
    {**SGLANG, "replicas": 4, "prefill": {"maxReplicas": 1}},       # decode scales alone
    {**SGLANG, "decode": {"replicas": 3}},
    {**SGLANG, "routing": {"precisePrefixCache": False, "proxyKvConnector": "sglang"}},
    {"routing": {"proxyKvConnector": "shared-storage"}},
]


@pytest.mark.parametrize("patch,message", REFUSED_BOUNDS)
def test_bounds_that_serve_nothing_or_that_lws_or_sglang_refuse_are_refused(patch, message):
    body = ServingBody().spec(**patch).build()
    assert any(message in e for e in schema_errors(body)), schema_errors(body)
    with pytest.raises(PlanError, match=message.split(":")[0].replace(".", r"\.")):
        plan(ServingBody().spec(**patch), PoolBody().spec(capacity={"hosts": 8}))


@pytest.mark.parametrize("patch", ACCEPTED_BOUNDS)
def test_bounds_that_serve_are_accepted(patch):
    assert schema_errors(ServingBody().spec(**patch).build()) == []
    plan(ServingBody().spec(**patch), PoolBody().spec(capacity={"hosts": 8}))


def test_the_proxy_connectors_are_the_routing_proxys():
    assert set(typing.get_args(ProxyKVConnector)) == versions.ROUTING_PROXY.values["kv_connectors"]


@pytest.mark.parametrize("routing", [{"eppHighAvailability": "ActiveActive", "eppReplicas": 1},
                                     {"eppHighAvailability": "ActiveActive", "enabled": False}])
def test_active_active_without_two_pickers_is_refused(routing):
    errors = schema_errors(ServingBody().spec(routing=routing).build())
    assert any("spec.routing.eppHighAvailability ActiveActive needs spec.routing.enabled" in e for e in errors)
    assert schema_errors(ServingBody().spec(routing={"eppHighAvailability": "ActiveActive"}).build()) == []


# ------------------------------------------------------------------ pools

def test_queued_provisioning_is_refused_naming_the_field():
    body = PoolBody().gke(queuedProvisioning=True).build()
    assert any("spec.provisioning.gke.queuedProvisioning: true is not supported" in e for e in schema_errors(body))
    with pytest.raises(PlanError, match=r"spec\.provisioning\.gke\.queuedProvisioning"):
        check_pool(TPUSyncPoolSpec.model_validate(body["spec"]))


@pytest.mark.parametrize("mode", ["existing", "gke"])
@pytest.mark.parametrize("capacity,field", [
    ({"hosts": 6}, "spec.capacity.hosts"),
    ({"autoscaling": {"minHosts": 0, "maxHosts": 6}}, "spec.capacity.autoscaling"),
    ({"autoscaling": {"minHosts": 2, "maxHosts": 8}}, "spec.capacity.autoscaling"),
])
def test_partial_multi_host_slices_are_refused_in_either_mode(mode, capacity, field):
    pool = PoolBody().spec(tpu={"type": "v6e", "topology": "4x4"}, capacity=capacity)     # 4 hosts a slice
    if mode == "gke":
        pool = pool.gke()
    with pytest.raises(PlanError, match=field.replace(".", r"\.") + ".*multiple"):
        check_pool(TPUSyncPoolSpec.model_validate(pool.build()["spec"]))
    errors = check([pool.build()])
    assert any(field in e and "of 4" in e for e in errors), errors


@pytest.mark.parametrize("capacity", [{"hosts": 8}, {"autoscaling": {"minHosts": 4, "maxHosts": 8}}, {}])
def test_whole_multi_host_slices_are_accepted_in_mode_existing(capacity):
    pool = PoolBody().spec(tpu={"type": "v6e", "topology": "4x4"}, capacity=capacity)
    assert check([pool.build()]) == []


def test_a_shared_tier_size_beside_a_claim_and_a_capacity_beyond_the_size_are_refused():
    size = PoolBody().spec(tiers={"shared": {"claimName": "kv", "size": "18Ti"}}).build()
    assert any("spec.tiers.shared.size applies only with storageClassName" in e for e in schema_errors(size))
    beyond = PoolBody().spec(tiers={"shared": {"storageClassName": "lustre", "size": "1Ti", "capacity": "2Ti"}})
    assert any("spec.tiers.shared.capacity must not exceed spec.tiers.shared.size" in e
               for e in schema_errors(beyond.build()))
    within = PoolBody().spec(tiers={"shared": {"storageClassName": "lustre", "size": "2Ti", "capacity": "2Ti"}})
    assert schema_errors(within.build()) == []


def claim(storage: str, bound: bool = True) -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "kv", "namespace": "ns"},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
            "status": {"capacity": {"storage": storage}} if bound else {}}


def test_a_capacity_beyond_the_claims_size_is_named_from_the_claim():
    spec = TPUSyncPoolSpec.model_validate(
        PoolBody().spec(tiers={"shared": {"claimName": "kv", "capacity": "2Ti"}}).build()["spec"])
    problem = shared_claim_problem(spec, claim("1Ti"))
    assert "spec.tiers.shared.capacity 2Ti exceeds the 1Ti of PersistentVolumeClaim kv" in (problem or "")
    assert shared_claim_problem(spec, claim("2Ti")) is None
    assert "exceeds the 1Gi" in (shared_claim_problem(spec, claim("", bound=False)) or "")   # not bound: its request
    assert shared_claim_problem(spec, None) is None       # absent: the pods' volume says so


def test_the_pool_pass_reads_the_claim_and_reports_a_capacity_beyond_it(kube, clock):
    from test_operator_reconcile import deps
    body = PoolBody().spec(tiers={"shared": {"claimName": "kv", "capacity": "2Ti"}}).build()
    kube.put(claim("1Ti"))
    kube.put(body)
    with pytest.raises(kopf.TemporaryError):
        asyncio.run(reconcile_pool(body, deps(kube, clock)))
    cond = {c["type"]: c for c in kube.find("TPUSyncPool", "pool")["status"]["conditions"]}
    assert cond["Degraded"]["reason"] == SHARED_CAPACITY_BEYOND_CLAIM
    assert "spec.tiers.shared.capacity 2Ti exceeds the 1Ti" in cond["Degraded"]["message"]
    kube.put(claim("4Ti"))
    asyncio.run(reconcile_pool(body, deps(kube, clock)))
    cond = {c["type"]: c for c in kube.find("TPUSyncPool", "pool")["status"]["conditions"]}
    assert cond["Degraded"]["status"] == "False"


# ------------------------------------------------------------------ llm-d's block size

def test_the_reference_page_size_is_the_reference_engines():
    from tpusync.engines.reference.model import ModelConfig
    assert ModelConfig().page_size == REFERENCE_PAGE_SIZE


PAGE_48 = '--model-config={"page_size": 48}'


@pytest.mark.parametrize("patch,refused", [
    ({"routing": {"blockSizeTokens": 64}}, "the reference engine's page is 32 tokens"),
    ({"routing": {"blockSizeTokens": 32}, "prefill": {"args": [PAGE_48]}, "decode": {"args": [PAGE_48]}},
     "spec.prefill.args --model-config page_size is 48 tokens"),
    ({"engine": {"type": "vllm-tpu"}, "routing": {"blockSizeTokens": 32}, "decode": {"args": ["--block-size=16"]}},
     "spec.decode.args --block-size is 16 tokens"),
    ({"engine": {"type": "vllm-tpu"}, "routing": {"blockSizeTokens": 32}, "decode": {"args": ["--block_size", "48"]}},
     "spec.decode.args --block-size is 48 tokens"),
    ({"routing": {"blockSizeTokens": 16}, "prefill": {"args": [PAGE_48]}, "decode": {"args": [PAGE_48]}}, None),
    ({"routing": {"blockSizeTokens": 64, "precisePrefixCache": False}}, None),      # no KV events indexed
    ({"engine": {"type": "vllm-tpu"}, "routing": {"blockSizeTokens": 32}}, None),   # tpu-inference picks it
    ({"engine": {"type": "vllm-tpu"}, "routing": {"blockSizeTokens": 32}, "decode": {"args": ["--block-size=64"]}},
     None),
])
def test_block_size_tokens_must_divide_every_engines_page_size(patch, refused):
    docs = [PoolBody().build(), ServingBody().spec(**patch).build()]
    errors = check(docs)
    if refused is None:
        assert errors == []
    else:
        assert any("spec.routing.blockSizeTokens" in e and refused in e for e in errors), errors


# ------------------------------------------------------------------ encryption

def sidecars(objects) -> list[dict]:
    out = []
    for obj in objects:
        template = obj.body.get("spec", {}).get("template") or obj.body.get("spec", {}).get(
            "leaderWorkerTemplate", {}).get("leaderTemplate")
        for c in (template or {}).get("spec", {}).get("initContainers", []) + \
                (template or {}).get("spec", {}).get("containers", []):
            if c["name"] == "tpusync-sidecar":
                out.append(c)
    return out


@pytest.mark.parametrize("encrypt", [True, False])
def test_the_pool_encrypts_its_data_port_through_the_sidecar_flag(encrypt):
    pool = PoolBody().spec(sidecar={"encrypt": encrypt}, storeNodes={"enabled": True})
    found = sidecars(render([pool.build(), ServingBody().build()]))
    assert len(found) == 3      # the store node and each role's serving pod
    assert all(("--encrypt" in c["args"]) == encrypt for c in found)
