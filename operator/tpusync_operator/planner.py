"""Pure planning: from (spec, observed state) to the children to apply, the children to
delete, and the next step for the GKE node pool. No I/O; the reconcilers execute plans."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .builders import llmd, names
from .builders import pool as pool_builders
from .builders import serving as serving_builders
from .builders.common import Owner
from .builders.serving import PoolInfo, RolePlan
from .models import DisaggregatedServingSpec, TPUSyncPoolSpec
from .tpu import Slice, TopologyError, slice_for


class PlanError(ValueError):
    """The spec is valid for the schema but cannot be realised; the message names the field."""


@dataclass(frozen=True)
class Ref:
    """A child to delete: (apiVersion, kind, name) in the owner's namespace."""
    api_version: str
    kind: str
    name: str


# Optional CRDs: kind -> (apiVersion, plural). Their absence degrades, never crashes.
OPTIONAL_KINDS = {
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    "InferenceObjective": ("llm-d.ai/v1alpha2", "inferenceobjectives"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproutes"),
}


def missing_crd_message(kinds: list[str]) -> str:
    parts = [f"{k} ({OPTIONAL_KINDS[k][1]}.{OPTIONAL_KINDS[k][0].split('/')[0]})" for k in sorted(kinds)]
    return "CRD not installed in the cluster: " + ", ".join(parts)


# ------------------------------------------------------------------ pool

@dataclass
class PoolPlan:
    tpu: Slice
    desired_hosts: int
    min_ready_hosts: int
    apply: list[dict[str, Any]]
    delete: list[Ref]
    node_selector: dict[str, str]
    node_pool_request: dict[str, Any] | None     # mode gke only
    store_replicas: int                           # desired store pods; -1 for a DaemonSet


def check_pool(spec: TPUSyncPoolSpec) -> Slice:
    """Rules the schema cannot express; raises PlanError naming the field."""
    try:
        tpu = slice_for(spec.tpu.type, spec.tpu.topology)
    except TopologyError as e:
        raise PlanError(str(e)) from None
    cap = spec.capacity
    if spec.provisioning.mode == "gke" and tpu.multi_host:
        if tpu.tpu_type == "v7x" and not spec.provisioning.gke.workload_policy:
            raise PlanError(f"spec.provisioning.gke.workloadPolicy is required for the v7x multi-host "
                            f"topology {tpu.topology} ({tpu.hosts} hosts)")
        if cap.hosts is not None and cap.hosts != tpu.hosts:
            raise PlanError(f"spec.capacity.hosts must be {tpu.hosts} for topology {tpu.topology}: a GKE "
                            f"multi-host node pool is exactly one slice")
        if cap.autoscaling is not None and (cap.autoscaling.min_hosts not in (0, tpu.hosts)
                                            or cap.autoscaling.max_hosts != tpu.hosts):
            raise PlanError(f"spec.capacity.autoscaling must scale a multi-host slice atomically: "
                            f"minHosts 0 or {tpu.hosts}, maxHosts {tpu.hosts}")
    return tpu


def pool_hosts(spec: TPUSyncPoolSpec, tpu: Slice) -> tuple[int, int]:
    """(desired hosts, fewest ready hosts that count as Ready) of a pool."""
    cap = spec.capacity
    if cap.autoscaling is not None:
        return cap.autoscaling.max_hosts, cap.autoscaling.min_hosts
    hosts = cap.hosts if cap.hosts is not None else tpu.hosts
    return hosts, hosts


def plan_pool(owner: Owner, spec: TPUSyncPoolSpec) -> PoolPlan:
    tpu = check_pool(spec)
    desired, minimum = pool_hosts(spec, tpu)
    apply = [
        pool_builders.build_config_map(owner, spec, tpu),
        pool_builders.build_peers_service(owner, spec),
        pool_builders.build_network_policy(owner, spec),
    ]
    delete: list[Ref] = []
    store = spec.store_nodes
    store_name = names.pool_store(owner.name)
    if store.enabled:
        apply.append(pool_builders.build_store_nodes(owner, spec))
        other = "DaemonSet" if store.kind == "StatefulSet" else "StatefulSet"
        delete.append(Ref("apps/v1", other, store_name))
        replicas = -1 if store.kind == "DaemonSet" else (1 if store.replicas is None else store.replicas)
    else:
        delete += [Ref("apps/v1", "StatefulSet", store_name), Ref("apps/v1", "DaemonSet", store_name)]
        replicas = 0
    request = pool_builders.build_node_pool_request(owner, spec, tpu) if spec.provisioning.mode == "gke" else None
    return PoolPlan(tpu=tpu, desired_hosts=desired, min_ready_hosts=minimum, apply=apply, delete=delete,
                    node_selector=pool_builders.pool_node_selector(owner.name, spec),
                    node_pool_request=request, store_replicas=replicas)


# ------------------------------------------------------------- node pool

@dataclass(frozen=True)
class NodePoolStep:
    """What to do next about the GKE node pool, and how to report it."""
    action: str          # "create" | "wait" | "none"
    state: str           # shown in status.nodePool.state
    ready: bool
    degraded_reason: str | None = None
    message: str = ""


_TRANSIENT_STATES = {"PROVISIONING", "RECONCILING", "STOPPING", "STATUS_UNSPECIFIED"}


def node_pool_drift(request: dict[str, Any], observed: dict[str, Any]) -> list[str]:
    """Fields of the desired node pool that differ from GKE and cannot be changed in place."""
    want = request["nodePool"]
    drift = []
    if observed.get("config", {}).get("machineType") != want["config"]["machineType"]:
        drift.append("machineType")
    if bool(observed.get("config", {}).get("spot", False)) != bool(want["config"].get("spot", False)):
        drift.append("spot")
    want_pp, got_pp = want.get("placementPolicy", {}), observed.get("placementPolicy", {}) or {}
    for key in ("tpuTopology", "policyName"):
        if want_pp.get(key) != got_pp.get(key):
            drift.append(f"placementPolicy.{key}")
    return drift


def node_pool_step(request: dict[str, Any], operation: dict[str, Any] | None,
                   observed: dict[str, Any] | None) -> NodePoolStep:
    """Decide from the pending operation (if any) and the observed node pool (None: absent)."""
    if operation is not None and operation.get("status") != "DONE":
        return NodePoolStep("wait", observed.get("status", "PROVISIONING") if observed else "PROVISIONING",
                            False, message=f"GKE operation {operation.get('name')} is {operation.get('status')}")
    op_error = (operation or {}).get("error")
    if observed is None:
        if op_error:
            return NodePoolStep("create", "ERROR", False, "NodePoolOperationFailed",
                                f"GKE operation {operation.get('name')} failed: {op_error.get('message', op_error)}; retrying")
        return NodePoolStep("create", "CREATING", False, message="creating the GKE node pool")
    state = observed.get("status", "STATUS_UNSPECIFIED")
    if state in _TRANSIENT_STATES:
        return NodePoolStep("wait", state, False, message=f"node pool is {state}")
    if state in ("ERROR", "RUNNING_WITH_ERROR"):
        return NodePoolStep("none", state, state == "RUNNING_WITH_ERROR", "NodePoolError",
                            observed.get("statusMessage") or f"node pool is {state}")
    drift = node_pool_drift(request, observed)
    if drift:
        return NodePoolStep("none", state, True, "NodePoolDrift",
                            "node pool differs in " + ", ".join(drift)
                            + "; GKE cannot change these in place: delete the node pool to recreate it")
    return NodePoolStep("none", state, True)


# ---------------------------------------------------------------- serving

@dataclass
class ServingPlan:
    roles: list[RolePlan]
    apply: list[dict[str, Any]]
    delete: list[Ref]
    missing_kinds: list[str] = field(default_factory=list)
    required_kinds: list[str] = field(default_factory=list)


def plan_roles(spec: DisaggregatedServingSpec, pool: PoolInfo) -> list[RolePlan]:
    plans = []
    for role in ("prefill", "decode"):
        r = spec.prefill if role == "prefill" else spec.decode
        if spec.engine.cpu_only:
            hosts, chips = r.hosts_per_replica or 1, 0
        else:
            topology = r.topology or pool.tpu.topology
            if topology != pool.tpu.topology:
                raise PlanError(f"spec.{role}.topology {topology} does not match TPUSyncPool {pool.name} "
                                f"topology {pool.tpu.topology} (one node pool has one slice shape)")
            hosts, chips = pool.tpu.hosts, pool.tpu.chips_per_host
            if r.hosts_per_replica is not None and r.hosts_per_replica != hosts:
                raise PlanError(f"spec.{role}.hostsPerReplica must be {hosts} for topology {topology}")
        kind = "LeaderWorkerSet" if hosts > 1 else "Deployment"
        plans.append(RolePlan(role=role, replicas=r.replicas, hosts_per_replica=hosts,
                              chips_per_host=chips, kind=kind))
    return plans


def capacity_shortfall(roles: list[RolePlan], pool: PoolInfo) -> str | None:
    """Why the pool cannot hold every TPU replica of the serving at once, or None. Each
    replica takes whole hosts (a multi-host replica a whole slice)."""
    need = {r.role: r.replicas * r.hosts_per_replica for r in roles if r.chips_per_host}
    have, _ = pool_hosts(pool.spec, pool.tpu)
    if sum(need.values()) <= have:
        return None
    parts = " + ".join(f"{r.role} {r.replicas} x {r.hosts_per_replica}" for r in roles if r.chips_per_host)
    hint = (" (a GKE multi-host node pool is one slice: give each multi-host replica its own slice, e.g. a "
            "pool in mode existing over several node pools)" if pool.tpu.multi_host
            and pool.spec.provisioning.mode == "gke" else "")
    return (f"spec.prefill/spec.decode need {sum(need.values())} TPU hosts ({parts}) but TPUSyncPool "
            f"{pool.name} has {have}{hint}; the replicas that do not fit stay Pending")


def plan_serving(owner: Owner, spec: DisaggregatedServingSpec, pool: PoolInfo,
                 available_kinds: set[str]) -> ServingPlan:
    """available_kinds: the optional kinds (OPTIONAL_KINDS) served by the cluster."""
    roles = plan_roles(spec, pool)
    required: set[str] = {p.kind for p in roles if p.kind == "LeaderWorkerSet"}
    if spec.routing.enabled:
        required |= {"InferencePool", "InferenceObjective"}
        if spec.routing.gateway_ref is not None:
            required.add("HTTPRoute")
    missing = sorted(required - available_kinds)
    apply: list[dict[str, Any]] = []
    delete: list[Ref] = []
    for p in roles:
        name = names.role(owner.name, p.role)
        if p.kind in missing:
            continue
        apply.append(serving_builders.build_role_workload(owner, spec, pool, p))
        apply.append(serving_builders.build_role_service(owner, spec, p.role))
        if p.kind == "Deployment" and "LeaderWorkerSet" in available_kinds:
            delete.append(Ref(OPTIONAL_KINDS["LeaderWorkerSet"][0], "LeaderWorkerSet", name))
        elif p.kind == "LeaderWorkerSet":
            delete.append(Ref("apps/v1", "Deployment", name))
    apply.append(serving_builders.build_serving_network_policy(owner, spec))
    epp = names.epp(owner.name)
    epp_children = [Ref("apps/v1", "Deployment", epp), Ref("v1", "Service", epp), Ref("v1", "ConfigMap", epp),
                    Ref("rbac.authorization.k8s.io/v1", "RoleBinding", epp),
                    Ref("rbac.authorization.k8s.io/v1", "Role", epp), Ref("v1", "ServiceAccount", epp),
                    Ref("networking.k8s.io/v1", "NetworkPolicy", epp)]
    if spec.routing.enabled:
        events_port = pool.spec.sidecar.kv_events_port
        apply += [llmd.build_epp_service_account(owner), llmd.build_epp_role(owner),
                  llmd.build_epp_role_binding(owner), llmd.build_epp_config_map(owner, spec, events_port),
                  llmd.build_epp_deployment(owner, spec, events_port), llmd.build_epp_service(owner),
                  llmd.build_epp_network_policy(owner)]
        if "InferencePool" not in missing:
            apply.append(llmd.build_inference_pool(owner, spec))
        if "InferenceObjective" not in missing:
            apply.append(llmd.build_inference_objective(owner, spec))
        if spec.routing.gateway_ref is not None and "HTTPRoute" not in missing:
            apply.append(llmd.build_http_route(owner, spec))
    else:
        delete += epp_children
    for kind in ("InferencePool", "InferenceObjective", "HTTPRoute"):
        wanted = spec.routing.enabled and (kind != "HTTPRoute" or spec.routing.gateway_ref is not None)
        if not wanted and kind in available_kinds:
            delete.append(Ref(OPTIONAL_KINDS[kind][0], kind, owner.name))
    return ServingPlan(roles=roles, apply=apply, delete=delete, missing_kinds=missing,
                       required_kinds=sorted(required))
