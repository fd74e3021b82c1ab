"""Planner: TPU slice arithmetic, spec rules the schema cannot catch, the GKE node pool
state machine, and serving plans (optional CRDs, pruning)."""

from __future__ import annotations

import pytest
from op_helpers import PoolBody, ServingBody

from tpusync_operator.builders.common import Owner
from tpusync_operator.builders.serving import PoolInfo
from tpusync_operator.models import DisaggregatedServingSpec, TPUSyncPoolSpec
from tpusync_operator.pool_plan import NodePoolAction as A
from tpusync_operator.pool_plan import PlanError, Ref, check_pool, node_pool_size_change, node_pool_step, plan_pool
from tpusync_operator.pool_plan import SizeAction as S
from tpusync_operator.serving_plan import (
    capacity_shortfall,
    missing_crd_message,
    plan_roles,
    plan_serving,
    role_replicas,
)
from tpusync_operator.tpu import TopologyError, slice_for


@pytest.mark.parametrize("tpu,topology,chips,per_host,hosts,machine", [
    ("v6e", "1x1", 1, 1, 1, "ct6e-standard-1t"),
    ("v6e", "2x2", 4, 4, 1, "ct6e-standard-4t"),
    ("v6e", "2x4", 8, 8, 1, "ct6e-standard-8t"),
    ("v6e", "4x4", 16, 4, 4, "ct6e-standard-4t"),
    ("v6e", "16x16", 256, 4, 64, "ct6e-standard-4t"),
    ("v7x", "2x2x1", 4, 4, 1, "tpu7x-standard-4t"),
    ("v7x", "2x2x2", 8, 4, 2, "tpu7x-standard-4t"),
    ("v7x", "4x4x4", 64, 4, 16, "tpu7x-standard-4t"),
])
def test_slices(tpu, topology, chips, per_host, hosts, machine):
    s = slice_for(tpu, topology)
    assert (s.chips, s.chips_per_host, s.hosts, s.machine_type) == (chips, per_host, hosts, machine)
    assert s.multi_host == (hosts > 1)


@pytest.mark.parametrize("tpu,topology", [("v6e", "3x3"), ("v6e", "2x2x2"), ("v7x", "2x4"), ("v7x", "1x1x3"),
                                          ("v6e", "0x4"), ("v5p", "2x2x2")])
def test_bad_slices(tpu, topology):
    with pytest.raises(TopologyError, match=r"spec\.tpu"):
        slice_for(tpu, topology)


def pool_spec(body):
    return TPUSyncPoolSpec.model_validate(body.build()["spec"])


@pytest.mark.parametrize("body,field", [
    (PoolBody().v7x("2x2x2").gke(), "spec.provisioning.gke.workloadPolicy"),
    (PoolBody().spec(tpu={"topology": "4x4"}).gke().spec(capacity={"hosts": 6}), "spec.capacity.hosts"),
    (PoolBody().spec(tpu={"topology": "4x4"}).gke().spec(capacity={"autoscaling": {"minHosts": 1, "maxHosts": 4}}),
     "spec.capacity.autoscaling"),
    (PoolBody().spec(tpu={"topology": "3x3"}), "spec.tpu.topology"),
])
def test_plan_errors_name_the_field(body, field):
    with pytest.raises(PlanError, match=field.replace(".", r"\.")):
        check_pool(pool_spec(body))


def test_multi_host_existing_pool_allows_many_hosts():
    assert check_pool(pool_spec(PoolBody().spec(tpu={"topology": "4x4"}, capacity={"hosts": 8}))).hosts == 4


def test_plan_pool_children_and_pruning():
    body = PoolBody().build()
    p = plan_pool(Owner.from_body(body), pool_spec(PoolBody()))
    assert [o["kind"] for o in p.apply] == ["Service", "NetworkPolicy"]
    old_config = Ref("v1", "ConfigMap", "pool-config")     # what earlier versions created
    assert set(p.delete) == {old_config, Ref("apps/v1", "StatefulSet", "pool-store"),
                             Ref("apps/v1", "DaemonSet", "pool-store")}
    assert p.node_pool_requests == [] and p.desired_hosts == 1
    p = plan_pool(Owner.from_body(body), pool_spec(PoolBody().store(kind="DaemonSet")))
    assert p.apply[-1]["kind"] == "DaemonSet" and p.delete == [old_config, Ref("apps/v1", "StatefulSet", "pool-store")]
    assert p.store_replicas is None      # a DaemonSet: one per selected node


# The labels of a node pool the operator created for its owner (builders.pool.node_pool_mark).
MARK = {"tpusync.dev/pool": "pool", "tpusync.dev/managed-by": "tpusync-operator", "tpusync.dev/owner-uid": "uid-pool"}
REQ = {"nodePool": {"name": "np", "config": {"machineType": "tpu7x-standard-4t", "spot": False, "labels": MARK},
                    "initialNodeCount": 2, "placementPolicy": {"type": "COMPACT", "policyName": "wp"}}}
GOOD = {"name": "np", "status": "RUNNING", "config": {"machineType": "tpu7x-standard-4t", "labels": MARK},
        "initialNodeCount": 2, "placementPolicy": {"type": "COMPACT", "policyName": "wp"}}


@pytest.mark.parametrize("op,observed,action,state,ready,reason", [
    (None, None, A.CREATE, "CREATING", False, None),
    ({"name": "op1", "status": "RUNNING"}, None, A.WAIT, "PROVISIONING", False, None),
    ({"name": "op1", "status": "RUNNING"}, {**GOOD, "status": "PROVISIONING"}, A.WAIT, "PROVISIONING", False, None),
    ({"name": "op1", "status": "DONE", "error": {"message": "quota"}}, None, A.CREATE, "ERROR", False,
     "NodePoolOperationFailed"),
    ({"name": "op1", "status": "DONE"}, GOOD, A.NONE, "RUNNING", True, None),
    (None, GOOD, A.NONE, "RUNNING", True, None),
    (None, {**GOOD, "status": "RECONCILING"}, A.WAIT, "RECONCILING", False, None),
    (None, {**GOOD, "status": "ERROR", "statusMessage": "boom"}, A.NONE, "ERROR", False, "NodePoolError"),
    (None, {**GOOD, "status": "RUNNING_WITH_ERROR"}, A.NONE, "RUNNING_WITH_ERROR", True, "NodePoolError"),
    (None, {**GOOD, "config": {"machineType": "other", "labels": MARK}}, A.NONE, "RUNNING", True, "NodePoolDrift"),
    (None, {**GOOD, "placementPolicy": {"type": "COMPACT", "policyName": "x"}}, A.NONE, "RUNNING", True,
     "NodePoolDrift"),
])
def test_node_pool_step(op, observed, action, state, ready, reason):
    step = node_pool_step(REQ, op, observed, node_count=2, multi_host=True)
    assert (step.action, step.state, step.ready, step.degraded_reason) == (action, state, ready, reason)


# Sizing edits: a single-host pool (v6e 2x4, 1 host per node) and a multi-host slice of 4 nodes.
def single(count=None, autoscaling=None):
    np = {"name": "np", "config": {"machineType": "ct6e-standard-8t", "labels": MARK}, "initialNodeCount": count or 0}
    if autoscaling:
        np["autoscaling"] = {"enabled": True, "minNodeCount": autoscaling[0], "maxNodeCount": autoscaling[1]}
    return {"nodePool": np}


def seen(initial, autoscaling=None, **extra):
    """A node pool as GET returns it: zero and false fields left out, GKE's defaults added."""
    np = {"name": "np", "status": "RUNNING", "config": {"machineType": "ct6e-standard-8t", "labels": MARK},
          "initialNodeCount": initial, **extra}
    if autoscaling:
        np["autoscaling"] = {k: v for k, v in {"enabled": True, "minNodeCount": autoscaling[0],
                                               "maxNodeCount": autoscaling[1]}.items() if v}
        np["autoscaling"]["locationPolicy"] = "BALANCED"
    return np


@pytest.mark.parametrize("want,observed,recorded,multi,action,autoscaling,count", [
    # nothing differs: no call
    (single(3), seen(3), 3, False, S.NONE, None, 3),
    (single(autoscaling=(0, 4)), seen(0, (0, 4)), None, False, S.NONE, None, None),
    (single(autoscaling=(1, 4)), seen(1, (1, 4)), None, False, S.NONE, None, None),
    # resize: compared with the size last set, not initialNodeCount (GKE never updates it)
    (single(5), seen(3), 3, False, S.SET_SIZE, None, 5),
    (single(1), seen(3), 3, False, S.SET_SIZE, None, 1),
    (single(3), seen(1), 3, False, S.NONE, None, 3),
    (single(3), seen(3), None, False, S.SET_SIZE, None, 3),        # size not known
    # autoscaling enabled, changed, disabled (then resized on a later pass: count unknown)
    (single(autoscaling=(0, 4)), seen(3), 3, False, S.SET_AUTOSCALING,
     {"enabled": True, "minNodeCount": 0, "maxNodeCount": 4}, None),
    (single(autoscaling=(1, 6)), seen(0, (0, 4)), None, False, S.SET_AUTOSCALING,
     {"enabled": True, "minNodeCount": 1, "maxNodeCount": 6}, None),
    (single(2), seen(0, (0, 4)), None, False, S.SET_AUTOSCALING, {"enabled": False}, None),
    (single(2), seen(0, {}), None, False, S.SET_SIZE, None, 2),
    # multi-host slices: never resized; autoscaling of the whole slice may change
    (single(4), seen(4), 4, True, S.NONE, None, 4),
    (single(4), seen(4), None, True, S.NONE, None, 4),
    (single(autoscaling=(0, 4)), seen(4), 4, True, S.SET_AUTOSCALING,
     {"enabled": True, "minNodeCount": 0, "maxNodeCount": 4}, None),
    (single(autoscaling=(4, 4)), seen(0, (0, 4)), None, True, S.SET_AUTOSCALING,
     {"enabled": True, "minNodeCount": 4, "maxNodeCount": 4}, None),
    (single(8), seen(4), 4, True, S.IMMUTABLE, None, 4),
    (single(autoscaling=(0, 8)), seen(0, (0, 4)), None, True, S.IMMUTABLE, None, None),
    (single(4), seen(0, (0, 4)), None, True, S.IMMUTABLE, None, None),
])
def test_node_pool_size_change(want, observed, recorded, multi, action, autoscaling, count):
    change = node_pool_size_change(want, observed, recorded, multi)
    assert (change.action, change.autoscaling, change.node_count) == (action, autoscaling, count)


@pytest.mark.parametrize("want,observed,field,advice", [
    (single(8), seen(4), "spec.tpu.topology needs 8 hosts", "delete the node pool"),
    (single(4), seen(0, (0, 4)), "spec.capacity.autoscaling was removed", "{minHosts: 4, maxHosts: 4}"),
])
def test_immutable_multi_host_edits_name_the_field(want, observed, field, advice):
    step = node_pool_step(want, None, observed, node_count=4, multi_host=True)
    assert (step.action, step.degraded_reason, step.ready) == (A.NONE, "NodePoolImmutable", True)
    assert field in step.message and advice in step.message and "multi-host" in step.message


def test_edits_wait_for_the_running_operation():
    resizing = {"name": "op2", "status": "RUNNING", "operationType": "SET_NODE_POOL_SIZE"}
    step = node_pool_step(single(5), resizing, seen(3), node_count=4)
    assert (step.action, step.ready, step.updating, step.node_count) == (A.WAIT, True, True, 4)
    assert "SET_NODE_POOL_SIZE" in step.message
    creating = {"name": "op1", "status": "RUNNING", "operationType": "CREATE_NODE_POOL"}
    step = node_pool_step(single(5), creating, {**seen(3), "status": "PROVISIONING"}, node_count=3)
    assert (step.action, step.ready, step.updating) == (A.WAIT, False, False)


def test_edit_steps_carry_the_request():
    step = node_pool_step(single(5), {"name": "op1", "status": "DONE"}, seen(3), node_count=3)
    assert (step.action, step.autoscaling, step.node_count, step.ready, step.updating) == (
        A.SET_SIZE, None, 5, True, True)
    assert step.degraded_reason is None and "to 5 nodes" in step.message
    assert node_pool_step(single(3), None, None).node_count == 3                  # created with its size
    assert node_pool_step(single(autoscaling=(0, 4)), None, None).node_count is None


def test_failed_edit_is_reported_then_sent_again():
    failed = {"name": "op2", "status": "DONE", "operationType": "SET_NODE_POOL_SIZE",
              "error": {"message": "quota exceeded"}}
    step = node_pool_step(single(5), failed, seen(3), node_count=5)
    assert (step.action, step.degraded_reason, step.node_count) == (A.NONE, "NodePoolUpdateFailed", None)
    assert "quota exceeded" in step.message
    again = node_pool_step(single(5), None, seen(3), node_count=step.node_count)
    assert (again.action, again.node_count) == (A.SET_SIZE, 5)


@pytest.mark.parametrize("labels", [
    None,                                                          # a node pool made by hand
    {"tpusync.dev/pool": "pool", "tpusync.dev/namespace": "ns"},   # the pool's name labels alone
    {**MARK, "tpusync.dev/owner-uid": "uid-other"},                # another TPUSyncPool's
    {**MARK, "tpusync.dev/managed-by": "someone"},
], ids=["unlabelled", "name-labels", "other-owner", "other-manager"])
@pytest.mark.parametrize("op", [None, {"name": "op1", "status": "DONE"}, {"name": "op1", "status": "RUNNING"}],
                         ids=["no-operation", "done", "running"])
def test_a_node_pool_without_the_owners_mark_is_never_touched(labels, op):
    """Whatever the spec asks (here a resize) and whatever the status recorded: a node pool
    without the mark the request would put on it is not the operator's."""
    config = {"machineType": "ct6e-standard-8t", **({"labels": labels} if labels else {})}
    observed = {**seen(1), "config": config}
    step = node_pool_step(single(3), op, observed, node_count=None)
    assert (step.action, step.state, step.ready, step.degraded_reason) == (
        A.NONE, "NotOwned", False, "NodePoolNotOwned")
    assert not step.action.calls_gke and step.autoscaling is None and step.node_count is None
    assert step.message.startswith("GKE node pool np exists but the operator did not create it")
    assert "tpusync.dev/managed-by=tpusync-operator, tpusync.dev/owner-uid=uid-pool" in step.message
    assert "spec.provisioning.gke.nodePoolName" in step.message and "delete node pool np yourself" in step.message
    # With the mark, the same node pool is the operator's: resized.
    assert node_pool_step(single(3), None, seen(1), node_count=None).action is A.SET_SIZE


def test_drift_message_names_fields():
    step = node_pool_step(REQ, None, {**GOOD, "config": {"machineType": "other", "spot": True, "labels": MARK}})
    assert "machineType" in step.message and "spot" in step.message


def serving_plan(serving, pool=None, available=frozenset({"LeaderWorkerSet", "InferencePool",
                                                          "InferenceObjective", "HTTPRoute"})):
    pool = PoolBody() if pool is None else pool
    body = serving.build()
    ps = pool_spec(pool)
    info = PoolInfo("pool", ps, check_pool(ps))
    return plan_serving(Owner.from_body(body), DisaggregatedServingSpec.model_validate(body["spec"]), info,
                        set(available))


def test_roles_single_and_multi_host():
    p = serving_plan(ServingBody())
    assert [(r.role, r.kind, r.hosts_per_replica, r.chips_per_host) for r in p.roles] == [
        ("prefill", "Deployment", 1, 8), ("decode", "Deployment", 1, 8)]
    p = serving_plan(ServingBody().spec(engine={"type": "vllm-tpu"}), PoolBody().v7x("2x2x2"))
    assert {r.kind for r in p.roles} == {"LeaderWorkerSet"} and p.roles[0].chips == 8
    assert Ref("apps/v1", "Deployment", "llm-prefill") in p.delete


@pytest.mark.parametrize("serving,field", [
    (ServingBody().spec(prefill={"topology": "2x2"}), "spec.prefill.topology"),
    (ServingBody().spec(decode={"hostsPerReplica": 2}), "spec.decode.hostsPerReplica"),
])
def test_role_plan_errors(serving, field):
    with pytest.raises(PlanError, match=field.replace(".", r"\.")):
        serving_plan(serving)


def test_missing_optional_crds_are_reported_not_applied():
    p = serving_plan(ServingBody().spec(routing={"gatewayRef": {"name": "gw"}}), PoolBody().v7x("2x2x2"),
                     available=frozenset())
    assert p.missing_kinds == ["HTTPRoute", "InferenceObjective", "InferencePool", "LeaderWorkerSet"]
    kinds = {o["kind"] for o in p.apply}
    assert not kinds & {"LeaderWorkerSet", "InferencePool", "InferenceObjective", "HTTPRoute"}
    assert {"Deployment", "ConfigMap", "Service"} <= kinds   # the EPP still deploys
    assert not any(r.kind in ("LeaderWorkerSet", "InferencePool") for r in p.delete)
    msg = missing_crd_message(p.missing_kinds)
    assert "LeaderWorkerSet (leaderworkersets.leaderworkerset.x-k8s.io)" in msg
    assert "InferencePool (inferencepools.inference.networking.k8s.io)" in msg


def test_routing_disabled_prunes_llmd_objects():
    p = serving_plan(ServingBody().spec(routing={"enabled": False}))
    assert {r.kind for r in p.delete} >= {"InferencePool", "InferenceObjective", "HTTPRoute", "Deployment", "Role"}
    assert not {o["kind"] for o in p.apply} & {"InferencePool", "Role"}
    assert p.missing_kinds == []
    # The EPP's policy goes with it; the serving pods keep theirs.
    assert ("NetworkPolicy", "llm-epp") in {(r.kind, r.name) for r in p.delete}
    assert [o["metadata"]["name"] for o in p.apply if o["kind"] == "NetworkPolicy"] == ["llm-serving"]


def test_network_policies_admit_the_gateway_and_the_serving_itself():
    """Under an enforcing CNI: clients reach the serving port, the serving's own pods reach
    each other on any port (LWS leader and workers, proxy to prefill), the gateway reaches
    the EPP's ext-proc port."""
    p = serving_plan(ServingBody().spec(routing={"gatewayRef": {"name": "gw"}}))
    policies = {o["metadata"]["name"]: o["spec"] for o in p.apply if o["kind"] == "NetworkPolicy"}
    serving, epp = policies["llm-serving"], policies["llm-epp"]
    assert serving["podSelector"] == {"matchLabels": {"tpusync.dev/serving": "llm"}}
    assert {"ports": [{"protocol": "TCP", "port": 8000}]} in serving["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": {"tpusync.dev/serving": "llm"}}}]} in serving["ingress"]
    epp_pods = next(o for o in p.apply if o["kind"] == "Deployment" and o["metadata"]["name"] == "llm-epp")
    assert epp["podSelector"]["matchLabels"].items() <= epp_pods["spec"]["template"]["metadata"]["labels"].items()
    # ext-proc, gRPC health (GKE's Gateway health-checks the EPP there) and metrics
    assert epp["ingress"] == [{"ports": [{"protocol": "TCP", "port": 9002}, {"protocol": "TCP", "port": 9003},
                                         {"protocol": "TCP", "port": 9090}]}]


def test_cpu_only_needs_no_tpu_match():
    p = serving_plan(ServingBody().spec(engine={"cpuOnly": True}, prefill={"topology": "1x1"}))
    assert all(r.chips_per_host == 0 and r.kind == "Deployment" for r in p.roles)


def pool_info(pool: PoolBody) -> PoolInfo:
    ps = pool_spec(pool)
    return PoolInfo("pool", ps, check_pool(ps))


@pytest.mark.parametrize("pool,serving,want", [
    # one 2-host v7x slice: P and D multi-host replicas need a slice each
    (PoolBody().v7x("2x2x2").gke(workloadPolicy="p"), ServingBody(),
     ["need 4 TPU hosts (prefill 1 x 2 + decode 1 x 2)", "has 2", "raise the pool's spec.capacity.hosts by 2"]),
    # two slices fit, through an existing pool or as two GKE node pools
    (PoolBody().v7x("2x2x2").spec(capacity={"hosts": 4}), ServingBody(), None),
    (PoolBody().v7x("2x2x2").gke(workloadPolicy="p").spec(capacity={"hosts": 4}), ServingBody(), None),
    # single-host replicas: one host each
    (PoolBody().spec(capacity={"hosts": 2}), ServingBody(), None),
    (PoolBody().spec(capacity={"hosts": 2}), ServingBody().spec(decode={"replicas": 3}),
     ["need 4 TPU hosts (prefill 1 x 1 + decode 3 x 1)", "has 2"]),
    (PoolBody().spec(capacity={"autoscaling": {"minHosts": 0, "maxHosts": 8}}).gke(),
     ServingBody().spec(decode={"replicas": 7}), None),
    # CPU-only engines take no TPU host
    (PoolBody(), ServingBody().spec(engine={"type": "reference", "cpuOnly": True}, decode={"replicas": 5}), None),
])
def test_capacity_shortfall(pool, serving, want):
    info = pool_info(pool)
    roles = plan_roles(DisaggregatedServingSpec.model_validate(serving.build()["spec"]), info)
    got = capacity_shortfall(roles)
    if want is None:
        assert got is None
    else:
        assert got is not None and all(w in got for w in want), got


def test_a_gke_pool_of_several_multi_host_slices_is_a_node_pool_per_slice():
    owner = Owner("tpusync.dev/v1alpha1", "TPUSyncPool", "pool", "ns", "uid")
    one = plan_pool(owner, pool_spec(PoolBody().spec(tpu={"topology": "4x4"}).gke()))
    assert [r.name for r in one.node_pool_requests] == ["pool"]
    assert [r.body["nodePool"]["name"] for r in one.node_pool_requests] == ["pool"]
    assert one.node_selector == {"cloud.google.com/gke-nodepool": "pool"}
    three = plan_pool(owner, pool_spec(PoolBody().spec(tpu={"topology": "4x4"}).gke().spec(capacity={"hosts": 12})))
    assert [r.name for r in three.node_pool_requests] == ["pool", "pool-1", "pool-2"]
    assert {r.body["nodePool"]["initialNodeCount"] for r in three.node_pool_requests} == {4}
    assert {r.body["nodePool"]["placementPolicy"]["tpuTopology"] for r in three.node_pool_requests} == {"4x4"}
    # The slices' nodes carry the pool's labels (the node pools' config labels).
    assert three.node_selector == {"tpusync.dev/pool": "pool", "tpusync.dev/namespace": "ns"}
    assert three.node_selector.items() <= three.node_pool_requests[2].body["nodePool"]["config"]["labels"].items()
    assert three.desired_hosts == 12


def test_sglang_jax_gets_a_bootstrap_registry():
    sglang = ServingBody().spec(engine={"type": "sglang-jax", "image": "r.example/sgl:main"},
                                kvTransfer={"connector": "sglang-jax"}, routing={"precisePrefixCache": False})
    p = serving_plan(sglang)
    boot = {o["kind"]: o for o in p.apply if o["metadata"]["name"] == "llm-pd-bootstrap"}
    assert set(boot) == {"Deployment", "Service"}
    pod = boot["Deployment"]["spec"]["template"]
    assert pod["metadata"]["labels"]["tpusync.dev/serving"] == "llm"     # inside the serving's policy
    assert "llm-d.ai/role" not in pod["metadata"]["labels"]               # not an inference endpoint
    assert "tolerations" not in pod["spec"] and boot["Deployment"]["spec"]["replicas"] == 1
    assert boot["Service"]["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert not any(o["metadata"]["name"] == "llm-pd-bootstrap" for o in serving_plan(ServingBody()).apply)
    with pytest.raises(PlanError, match=r"spec\.engine\.image is required"):
        serving_plan(ServingBody().spec(engine={"type": "sglang-jax"}, kvTransfer={"connector": "sglang-jax"}))


@pytest.mark.parametrize("units,prefill,decode,want", [
    (1, {"replicas": 1}, {"replicas": 3}, (1, 3)),
    (3, {"replicas": 1}, {"replicas": 3}, (3, 9)),      # the ratio held
    (0, {"replicas": 1}, {"replicas": 3}, (0, 0)),      # scaled to zero
    (4, {"replicas": 1, "maxReplicas": 2}, {"replicas": 2}, (2, 8)),   # a role's bound
    (0, {"replicas": 1, "minReplicas": 1}, {"replicas": 2, "minReplicas": 1}, (1, 1)),
])
def test_units_scale_both_roles_within_their_bounds(units, prefill, decode, want):
    spec = DisaggregatedServingSpec.model_validate(
        ServingBody().spec(replicas=units, prefill=prefill, decode=decode).build()["spec"])
    assert (role_replicas(spec, "prefill"), role_replicas(spec, "decode")) == want


def test_multi_host_roles_scale_by_whole_slices():
    pool = PoolBody().v7x("2x2x2").spec(capacity={"hosts": 16}).build()
    spec_pool = TPUSyncPoolSpec.model_validate(pool["spec"])
    info = PoolInfo("p", spec_pool, slice_for(spec_pool.tpu.type, spec_pool.tpu.topology))
    spec = DisaggregatedServingSpec.model_validate(
        ServingBody().spec(engine={"type": "vllm-tpu"}, replicas=2, decode={"replicas": 1}).build()["spec"])
    roles = {r.role: r for r in plan_roles(spec, info)}
    assert roles["decode"].kind == "LeaderWorkerSet" and roles["decode"].replicas == 2
    assert roles["decode"].hosts_per_replica == 2          # each replica one whole 2x2x2 slice
    assert capacity_shortfall(list(roles.values())) is None
    three = DisaggregatedServingSpec.model_validate(
        ServingBody().spec(engine={"type": "vllm-tpu"}, replicas=5, decode={"replicas": 1}).build()["spec"])
    assert "raise the pool's spec.capacity.hosts by 2 per slice" in capacity_shortfall(plan_roles(three, info))


LOCKSTEP_KINDS = frozenset({"LeaderWorkerSet", "DisaggregatedSet", "InferencePool", "InferenceObjective"})


def test_lockstep_is_one_disaggregated_set_of_both_roles():
    p = serving_plan(ServingBody().spec(rollout={"strategy": "Lockstep", "maxSurge": 1, "maxUnavailable": 0},
                                        replicas=2, decode={"replicas": 3}), available=LOCKSTEP_KINDS)
    (ds,) = [o for o in p.apply if o["kind"] == "DisaggregatedSet"]
    assert not [o for o in p.apply if o["kind"] in ("Deployment", "LeaderWorkerSet")
                and o["metadata"]["name"] in ("llm-prefill", "llm-decode")]
    assert ds["apiVersion"] == "disaggregatedset.x-k8s.io/v1" and ds["metadata"]["name"] == "llm"
    roles = {r["name"]: r for r in ds["spec"]["roles"]}
    assert list(roles) == ["prefill", "decode"]
    for name, replicas in (("prefill", 2), ("decode", 6)):      # units x per-unit, the ratio held
        lws = roles[name]["spec"]
        assert lws["replicas"] == replicas
        assert lws["rolloutStrategy"] == {"type": "RollingUpdate",
                                          "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}}
        group = lws["leaderWorkerTemplate"]
        # a single-host replica is a group of one: its leader, made from the worker template
        assert group["size"] == 1 and "leaderTemplate" not in group
        labels = group["workerTemplate"]["metadata"]["labels"]
        assert labels["llm-d.ai/role"] == name and labels["llm-d.ai/inference-serving"] == "true"
        assert roles[name]["metadata"]["labels"]["tpusync.dev/serving"] == "llm"
        # groups of one share the node pool: no exclusive topology (which would allow one group per pool)
        assert "annotations" not in roles[name]["metadata"]
    # the roles' own workloads go; their Services (selecting both revisions' pods) stay
    assert Ref("apps/v1", "Deployment", "llm-prefill") in p.delete
    assert Ref("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llm-decode") in p.delete
    assert {o["metadata"]["name"] for o in p.apply if o["kind"] == "Service"} >= {"llm-prefill", "llm-decode"}
    assert "DisaggregatedSet" in p.required_kinds


def test_lockstep_multi_host_roles_keep_leader_and_workers():
    pool = PoolBody().v7x("2x2x2").spec(capacity={"hosts": 8})
    p = serving_plan(ServingBody().spec(engine={"type": "vllm-tpu"}, rollout={"strategy": "Lockstep"}), pool=pool,
                     available=LOCKSTEP_KINDS)
    (ds,) = [o for o in p.apply if o["kind"] == "DisaggregatedSet"]
    group = ds["spec"]["roles"][0]["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["leaderTemplate"]["metadata"]["labels"]["llm-d.ai/inference-serving"] == "true"
    assert "llm-d.ai/inference-serving" not in group["workerTemplate"]["metadata"]["labels"]
    assert ds["spec"]["roles"][0]["metadata"]["annotations"] == {
        "leaderworkerset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}


def test_lockstep_without_the_crd_waits_and_independent_prunes_the_set():
    p = serving_plan(ServingBody().spec(rollout={"strategy": "Lockstep"}),
                     available=LOCKSTEP_KINDS - {"DisaggregatedSet"})
    assert p.missing_kinds == ["DisaggregatedSet"]
    assert "disaggregatedsets.disaggregatedset.x-k8s.io" in missing_crd_message(p.missing_kinds)
    assert not [o for o in p.apply if o["kind"] == "DisaggregatedSet"
                or (o["kind"], o["metadata"]["name"]) == ("Deployment", "llm-prefill")]
    back = serving_plan(ServingBody(), available=LOCKSTEP_KINDS)
    assert Ref("disaggregatedset.x-k8s.io/v1", "DisaggregatedSet", "llm") in back.delete
    assert {o["kind"] for o in back.apply} >= {"Deployment"}


@pytest.mark.parametrize("serving,match", [
    (ServingBody().spec(rollout={"strategy": "Lockstep"}, decode={"replicas": 0}), r"spec\.rollout\.strategy Lockstep"),
    (ServingBody(name="a" * 33).spec(rollout={"strategy": "Lockstep"}), r"metadata\.name: at most 32"),
])
def test_lockstep_refusals(serving, match):
    with pytest.raises(PlanError, match=match):
        serving_plan(serving, available=LOCKSTEP_KINDS)


def test_rollout_limits_reach_independent_workloads_too():
    p = serving_plan(ServingBody().spec(rollout={"maxSurge": 1, "maxUnavailable": 0}))
    dep = next(o for o in p.apply if o["kind"] == "Deployment")
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_an_autoscaled_multi_host_pool_is_a_node_pool_per_slice_that_gke_grows_whole():
    """minHosts 2, maxHosts 6 of 2-host v7x slices: three node pools, the first kept up, the other
    two scaled by GKE's autoscaler between 0 and a whole slice; a serving may count on all six."""
    body = PoolBody().v7x("2x2x2").gke(workloadPolicy="wp").spec(capacity={"autoscaling": {"minHosts": 2,
                                                                                          "maxHosts": 6}})
    plan = plan_pool(Owner.from_body(body.build()), pool_spec(body))
    ranges = [(r.name, r.body["nodePool"]["initialNodeCount"], r.body["nodePool"]["autoscaling"])
              for r in plan.node_pool_requests]
    assert ranges == [("pool", 2, {"enabled": True, "minNodeCount": 2, "maxNodeCount": 2}),
                      ("pool-1", 0, {"enabled": True, "minNodeCount": 0, "maxNodeCount": 2}),
                      ("pool-2", 0, {"enabled": True, "minNodeCount": 0, "maxNodeCount": 2})]
    assert (plan.desired_hosts, plan.min_ready_hosts) == (6, 2)
    assert plan.node_selector == {"tpusync.dev/pool": "pool", "tpusync.dev/namespace": "ns"}
    info = PoolInfo("pool", pool_spec(body), plan.tpu)
    spec = DisaggregatedServingSpec.model_validate(
        ServingBody().spec(engine={"type": "vllm-tpu"}, replicas=3, prefill={"replicas": 0}).build()["spec"])
    assert capacity_shortfall(plan_roles(spec, info)) is None              # three decode slices
    spec = DisaggregatedServingSpec.model_validate(
        ServingBody().spec(engine={"type": "vllm-tpu"}, replicas=4, prefill={"replicas": 0}).build()["spec"])
    assert "need 8 TPU hosts" in capacity_shortfall(plan_roles(spec, info))
