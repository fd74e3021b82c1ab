"""Pure planning: from (spec, observed state) to the children to apply, the children to
delete, and the next step for the GKE node pool. No I/O; the reconcilers execute plans.

Plans are typed: `PoolPlan` and `ServingPlan` hold the children to server-side apply
(Kubernetes objects, as the builders render them) and `Ref`s of the children to delete;
`NodePoolStep` says which one call (`NodePoolAction`) to make to GKE next, if any, with
what it needs. Invariants: a plan only names children of its owner; at most one GKE call
per node pool per pass (none while an operation runs)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from .builders import llmd, names, sglang_pd
from .builders import pool as pool_builders
from .builders import serving as serving_builders
from .builders.common import Owner
from .builders.serving import PoolInfo, RolePlan
from .models import (
    ENGINE_NONROOT_UID,
    ENGINE_PRIVILEGED_ESCALATION,
    GS_NEEDS_VLLM,
    LENGTH_NEEDS_VLLM,
    LOCKSTEP_NEEDS_BOTH_ROLES,
    MAX_MODEL_LEN_BEYOND_SCALING,
    MAX_MODEL_LEN_TOO_LONG,
    MAX_MODEL_LEN_UNDECLARED,
    REVISION_NEEDS_WEIGHTS,
    ROLE_POOLS_BOTH,
    SGLANG_IMAGE_REQUIRED,
    SGLANG_SINGLE_HOST,
    DisaggregatedServingSpec,
    TPUSyncPoolSpec,
)
from .quantity import to_bytes
from .status import NODE_POOL_NOT_OWNED
from .tpu import Slice, TopologyError, slice_for


class PlanError(ValueError):
    """The spec is valid for the schema but cannot be realised; the message names the field."""


Child = dict[str, Any]   # a Kubernetes object, as the API server takes it


@dataclass(frozen=True)
class Ref:
    """A child to delete: (apiVersion, kind, name) in the owner's namespace."""
    api_version: str
    kind: str
    name: str


# Optional CRDs: kind -> (apiVersion, plural). Their absence degrades, never crashes.
OPTIONAL_KINDS = {
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "DisaggregatedSet": ("disaggregatedset.x-k8s.io/v1", "disaggregatedsets"),
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    "InferenceObjective": ("llm-d.ai/v1alpha2", "inferenceobjectives"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproutes"),
    "HealthCheckPolicy": ("networking.gke.io/v1", "healthcheckpolicies"),
    "GCPBackendPolicy": ("networking.gke.io/v1", "gcpbackendpolicies"),
}
GKE_POLICY_KINDS = ("HealthCheckPolicy", "GCPBackendPolicy")


def missing_crd_message(kinds: list[str]) -> str:
    parts = [f"{k} ({OPTIONAL_KINDS[k][1]}.{OPTIONAL_KINDS[k][0].split('/')[0]})" for k in sorted(kinds)]
    return "CRD not installed in the cluster: " + ", ".join(parts)


# ------------------------------------------------------------------ pool

@dataclass(frozen=True)
class NodePoolRequest:
    """The GKE node pool of one slice: its name and the body of its create call
    (`{"nodePool": {...}}`, GKE's JSON), which is also what it must look like."""
    name: str
    body: dict[str, Any]


@dataclass
class PoolPlan:
    tpu: Slice
    desired_hosts: int
    min_ready_hosts: int
    apply: list[Child]
    delete: list[Ref]
    node_selector: dict[str, str]
    node_pool_requests: list[NodePoolRequest]    # mode gke: one per node pool (slice)
    store_replicas: int | None                    # desired store pods; None for a DaemonSet (one per node)


def check_pool(spec: TPUSyncPoolSpec) -> Slice:
    """Rules the schema cannot express; raises PlanError naming the field."""
    try:
        tpu = slice_for(spec.tpu.type, spec.tpu.topology)
    except TopologyError as e:
        raise PlanError(str(e)) from None
    cap = spec.capacity
    if spec.provisioning.mode == "gke" and tpu.multi_host:
        gke = spec.provisioning.gke
        if tpu.tpu_type == "v7x" and not (gke and gke.workload_policy):
            raise PlanError(f"spec.provisioning.gke.workloadPolicy is required for the v7x multi-host "
                            f"topology {tpu.topology} ({tpu.hosts} hosts)")
        if cap.hosts is not None and cap.hosts % tpu.hosts:
            raise PlanError(f"spec.capacity.hosts must be a multiple of {tpu.hosts} for topology {tpu.topology}: "
                            f"each slice is its own GKE node pool of {tpu.hosts} hosts")
        if cap.autoscaling is not None and (cap.autoscaling.min_hosts % tpu.hosts
                                            or cap.autoscaling.max_hosts % tpu.hosts):
            raise PlanError(f"spec.capacity.autoscaling: minHosts and maxHosts must be multiples of {tpu.hosts} "
                            f"for topology {tpu.topology}: each slice is its own GKE node pool, which GKE's "
                            f"autoscaler scales atomically between 0 and {tpu.hosts} hosts")
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
        pool_builders.build_peers_service(owner, spec),
        pool_builders.build_network_policy(owner, spec),
    ]
    if (claim := pool_builders.build_shared_claim(owner, spec)) is not None:
        apply.append(claim)
    # Earlier versions created <pool>-config, environment no process read: gone on upgrade.
    delete: list[Ref] = [Ref("v1", "ConfigMap", names.pool_config(owner.name))]
    store = spec.store_nodes
    store_name = names.pool_store(owner.name)
    if store.enabled:
        apply.append(pool_builders.build_store_nodes(owner, spec))
        other = "DaemonSet" if store.kind == "StatefulSet" else "StatefulSet"
        delete.append(Ref("apps/v1", other, store_name))
        replicas: int | None = None if store.kind == "DaemonSet" else \
            (1 if store.replicas is None else store.replicas)
    else:
        delete += [Ref("apps/v1", "StatefulSet", store_name), Ref("apps/v1", "DaemonSet", store_name)]
        replicas = 0
    bodies = [pool_builders.build_node_pool_request(owner, spec, tpu, i)
              for i in range(pool_builders.gke_slices(spec, tpu))] if spec.provisioning.mode == "gke" else []
    requests = [NodePoolRequest(b["nodePool"]["name"], b) for b in bodies]
    return PoolPlan(tpu=tpu, desired_hosts=desired, min_ready_hosts=minimum, apply=apply, delete=delete,
                    node_selector=pool_builders.pool_node_selector(owner.name, owner.namespace, spec, tpu),
                    node_pool_requests=requests, store_replicas=replicas)


# ------------------------------------------------------------- node pool

class NodePoolAction(enum.Enum):
    """The one GKE call a pass makes about a node pool (or none)."""
    CREATE = "create"                    # nodePools.create with the request body
    SET_SIZE = "set_size"                # nodePools.setSize to NodePoolStep.node_count
    SET_AUTOSCALING = "set_autoscaling"  # nodePools.setAutoscaling to NodePoolStep.autoscaling
    WAIT = "wait"                        # an operation runs, or the node pool is in transition
    NONE = "none"                        # nothing to change

    @property
    def calls_gke(self) -> bool:
        """Whether the action starts a GKE operation."""
        return self in (NodePoolAction.CREATE, NodePoolAction.SET_SIZE, NodePoolAction.SET_AUTOSCALING)


@dataclass(frozen=True)
class NodePoolStep:
    """What to do next about the GKE node pool, and how to report it."""
    action: NodePoolAction
    state: str           # shown in status.nodePool.state
    ready: bool
    degraded_reason: str | None = None
    message: str = ""
    autoscaling: dict[str, Any] | None = None   # SET_AUTOSCALING: GKE's NodePoolAutoscaling
    node_count: int | None = None        # status.nodePool.nodeCount once this step is taken (SET_SIZE: the size)
    updating: bool = False               # an edit of a serving node pool is in flight (Progressing)


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


class SizeAction(enum.Enum):
    NONE = "none"                        # the size and autoscaling match the spec
    SET_SIZE = "set_size"                # resize to SizeChange.node_count
    SET_AUTOSCALING = "set_autoscaling"  # set SizeChange.autoscaling
    IMMUTABLE = "immutable"              # a multi-host slice the spec would resize: reported, never sent


@dataclass(frozen=True)
class SizeChange:
    """How the node pool's size or autoscaling must change to match the spec."""
    action: SizeAction
    autoscaling: dict[str, Any] | None = None   # SET_AUTOSCALING: GKE's NodePoolAutoscaling
    node_count: int | None = None        # status.nodePool.nodeCount once the change is made
    message: str = ""


def _autoscaling_range(autoscaling: dict[str, Any] | None) -> tuple[int, int] | None:
    """(minNodeCount, maxNodeCount) of an enabled NodePoolAutoscaling; None when it is off.
    GKE's JSON leaves out zero and false fields, so a missing field reads as 0 / off."""
    a = autoscaling or {}
    if not a.get("enabled"):
        return None
    return int(a.get("minNodeCount", 0) or 0), int(a.get("maxNodeCount", 0) or 0)


def node_pool_size_change(request: dict[str, Any], observed: dict[str, Any], node_count: int | None,
                          multi_host: bool) -> SizeChange:
    """Compare the sizing the spec asks for (the create request: initialNodeCount, or an
    autoscaling range) with the node pool GKE reports.

    GKE's NodePool reports `autoscaling` as it is now, but no current node count:
    `initialNodeCount` stays what the pool was created with. node_count is therefore the size
    the operator last set (status.nodePool.nodeCount); None when not known (autoscaled before,
    a failed resize, a status from an older operator), which sends one setSize. A multi-host
    TPU slice is created and scaled atomically by GKE and cannot be resized by hand: an edit
    that needs a resize is reported ("immutable"), never sent."""
    want = request["nodePool"]
    name = want["name"]
    want_range = _autoscaling_range(want.get("autoscaling"))
    got_range = _autoscaling_range(observed.get("autoscaling"))
    want_count = None if want_range else int(want.get("initialNodeCount", 0))
    if multi_host:
        # The slice's nodes: the autoscaler's maximum, or the count it was created with.
        have = got_range[1] if got_range else int(observed.get("initialNodeCount", 0) or 0)
        need = want_range[1] if want_range else want_count
        if need != have:
            return SizeChange(SizeAction.IMMUTABLE, node_count=node_count, message=(
                f"spec.tpu.topology needs {need} hosts but GKE node pool {name} is a multi-host TPU slice "
                f"of {have}; GKE creates and scales a multi-host slice atomically and cannot resize it: "
                f"restore the topology, or delete the node pool so that the operator recreates it"))
        if want_range is None and got_range is not None:
            return SizeChange(SizeAction.IMMUTABLE, node_count=node_count, message=(
                f"spec.capacity.autoscaling was removed but GKE node pool {name} is a multi-host TPU slice "
                f"that only GKE's autoscaler can size (0 or {have} nodes): keep the slice up with "
                f"spec.capacity.autoscaling {{minHosts: {have}, maxHosts: {have}}}, or delete the node pool "
                f"so that the operator recreates it"))
    if want_range != got_range:
        if want_range is None:
            return SizeChange(SizeAction.SET_AUTOSCALING, {"enabled": False}, None,
                              f"turning autoscaling of GKE node pool {name} off")
        return SizeChange(SizeAction.SET_AUTOSCALING, dict(want["autoscaling"]), None,
                          f"autoscaling GKE node pool {name} between {want_range[0]} and {want_range[1]} nodes")
    if want_count is not None and not multi_host and node_count != want_count:
        return SizeChange(SizeAction.SET_SIZE, None, want_count,
                          f"resizing GKE node pool {name} to {want_count} nodes")
    return SizeChange(SizeAction.NONE, node_count=want_count)


def request_mark(request: dict[str, Any]) -> dict[str, str]:
    """The mark (builders.pool.node_pool_mark) a create request puts on its node pool."""
    labels = request["nodePool"]["config"]["labels"]
    return {k: labels[k] for k in pool_builders.NODE_POOL_MARK_KEYS}


def mark_text(mark: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in mark.items())


def not_owned_message(name: str, mark: dict[str, str]) -> str:
    return (f"GKE node pool {name} exists but the operator did not create it for this TPUSyncPool (it lacks the "
            f"labels {mark_text(mark)}), so the operator does not adopt, resize or delete it: set "
            f"spec.provisioning.gke.nodePoolName to a name no node pool has, or delete node pool {name} yourself "
            f"(the operator then creates its own)")


def node_pool_step(request: dict[str, Any], operation: dict[str, Any] | None,
                   observed: dict[str, Any] | None, *, node_count: int | None = None,
                   multi_host: bool = False) -> NodePoolStep:
    """Decide from the pending operation (if any), the observed node pool (None: absent) and
    the size the operator last set (node_count, see node_pool_size_change). At most one
    operation at a time: nothing is sent while the recorded one runs. A node pool without the
    request's mark is not the operator's: nothing is ever sent about it."""
    mark = request_mark(request)
    if observed is not None and not pool_builders.node_pool_marked(observed, mark):
        return NodePoolStep(NodePoolAction.NONE, "NotOwned", False, NODE_POOL_NOT_OWNED,
                            not_owned_message(request["nodePool"]["name"], mark))
    if operation is not None and operation.get("status") != "DONE":
        kind = operation.get("operationType", "CREATE_NODE_POOL")
        running = f"GKE operation {operation.get('name')} ({kind}) is {operation.get('status')}"
        if observed is not None and observed.get("status") != "PROVISIONING" and kind != "CREATE_NODE_POOL":
            # An edit of a node pool that keeps serving: Progressing, still ready.
            return NodePoolStep(NodePoolAction.WAIT, observed.get("status", "RUNNING"), True, message=running,
                                node_count=node_count, updating=True)
        return NodePoolStep(NodePoolAction.WAIT, observed.get("status", "PROVISIONING") if observed else "PROVISIONING",
                            False, message=running, node_count=node_count)
    operation = operation or {}
    op_error = operation.get("error")
    if observed is None:
        want = request["nodePool"]
        created = None if want.get("autoscaling") else want.get("initialNodeCount")
        if op_error:
            return NodePoolStep(NodePoolAction.CREATE, "ERROR", False, "NodePoolOperationFailed",
                                f"GKE operation {operation.get('name')} failed: "
                                f"{op_error.get('message', op_error)}; retrying", node_count=created)
        return NodePoolStep(NodePoolAction.CREATE, "CREATING", False, message="creating the GKE node pool",
                            node_count=created)
    state = observed.get("status", "STATUS_UNSPECIFIED")
    if state in _TRANSIENT_STATES:
        return NodePoolStep(NodePoolAction.WAIT, state, False, message=f"node pool is {state}", node_count=node_count)
    if state in ("ERROR", "RUNNING_WITH_ERROR"):
        return NodePoolStep(NodePoolAction.NONE, state, state == "RUNNING_WITH_ERROR", "NodePoolError",
                            observed.get("statusMessage") or f"node pool is {state}", node_count=node_count)
    drift = node_pool_drift(request, observed)
    if drift:
        return NodePoolStep(NodePoolAction.NONE, state, True, "NodePoolDrift",
                            "node pool differs in " + ", ".join(drift)
                            + "; GKE cannot change these in place: delete the node pool to recreate it",
                            node_count=node_count)
    if op_error:
        # A resize or autoscaling change failed: report it; the next pass sends it again
        # (the size is not known any more).
        return NodePoolStep(NodePoolAction.NONE, state, True, "NodePoolUpdateFailed",
                            f"GKE operation {operation.get('name')} failed: {op_error.get('message', op_error)}; "
                            f"retrying", node_count=None)
    change = node_pool_size_change(request, observed, node_count, multi_host)
    if change.action is SizeAction.IMMUTABLE:
        return NodePoolStep(NodePoolAction.NONE, state, True, "NodePoolImmutable", change.message,
                            node_count=change.node_count)
    if change.action is not SizeAction.NONE:
        action = NodePoolAction.SET_SIZE if change.action is SizeAction.SET_SIZE else NodePoolAction.SET_AUTOSCALING
        return NodePoolStep(action, state, True, message=change.message, autoscaling=change.autoscaling,
                            node_count=change.node_count, updating=True)
    return NodePoolStep(NodePoolAction.NONE, state, True, node_count=change.node_count)


# ---------------------------------------------------------------- serving

@dataclass
class ServingPlan:
    roles: list[RolePlan]
    apply: list[Child]
    delete: list[Ref]
    missing_kinds: list[str] = field(default_factory=list)
    required_kinds: list[str] = field(default_factory=list)


def role_replicas(spec: DisaggregatedServingSpec, role: str) -> int:
    """A role's replicas: its replicas per unit times the serving's units, within its bounds."""
    r = spec.role(role)
    n = spec.replicas * r.replicas
    if r.max_replicas is not None:
        n = min(n, r.max_replicas)
    if r.min_replicas is not None:
        n = max(n, r.min_replicas)
    return n


ROLES = ("prefill", "decode")


def pool_refs(spec: DisaggregatedServingSpec) -> dict[str, str]:
    """The TPUSyncPools a serving runs on, each with the field that names it: spec.poolRef's, and
    a role's own (spec.<role>.poolRef)."""
    refs = {spec.pool_ref.name: "spec.poolRef.name"}
    for role in ROLES:
        ref = spec.role(role).pool_ref
        if ref is not None:
            refs.setdefault(ref.name, f"spec.{role}.poolRef.name")
    return refs


def role_pools(spec: DisaggregatedServingSpec, by_name: dict[str, PoolInfo]) -> dict[str, PoolInfo]:
    """The pool of each role with a spec.<role>.poolRef of its own, from the pools `pool_refs` names."""
    return {role: by_name[ref.name] for role in ROLES if (ref := spec.role(role).pool_ref) is not None}


def check_role_pools(spec: DisaggregatedServingSpec, pools: dict[str, PoolInfo]) -> None:
    """Prefill and decode on two pools: the decode sidecars pull from the prefill sidecars of the
    other pool, so the pools must authenticate alike and store blocks alike, and the endpoint
    picker reads KV events on one port of every pod. Connectors other than tpusync pair prefill
    and decode hosts by rank and need one slice shape (tpusync's reshards on load)."""
    if pools["prefill"].name == pools["decode"].name:
        return
    own = "prefill" if spec.prefill.pool_ref is not None else "decode"
    mine, theirs = pools[own], pools["decode" if own == "prefill" else "prefill"]
    where = f"spec.{own}.poolRef.name: TPUSyncPool {mine.name}"
    my_secret, their_secret = names.pool_auth(mine.name, mine.spec), names.pool_auth(theirs.name, theirs.spec)
    if my_secret != their_secret:
        raise PlanError(f"{where} authenticates its data port with Secret {my_secret} and TPUSyncPool {theirs.name} "
                        f"with {their_secret}: KV moves between the two pools' sidecars, so set "
                        f"spec.auth.secretName of both pools to one Secret")
    if to_bytes(mine.spec.tiers.block_bytes) != to_bytes(theirs.spec.tiers.block_bytes):
        raise PlanError(f"{where} has spec.tiers.blockBytes {mine.spec.tiers.block_bytes} and TPUSyncPool "
                        f"{theirs.name} {theirs.spec.tiers.block_bytes}: a block one pool's sidecar stores is "
                        f"pulled whole into the other's, so both pools need one block size")
    if mine.spec.sidecar.kv_events_port != theirs.spec.sidecar.kv_events_port:
        raise PlanError(f"{where} has spec.sidecar.kvEventsPort {mine.spec.sidecar.kv_events_port} and TPUSyncPool "
                        f"{theirs.name} {theirs.spec.sidecar.kv_events_port}: the endpoint picker subscribes to one "
                        f"KV-events port on every engine pod of the serving")
    shape = (mine.tpu.tpu_type, mine.tpu.topology)
    if spec.kv_transfer.connector != "tpusync" and not spec.engine.cpu_only and \
            shape != (theirs.tpu.tpu_type, theirs.tpu.topology):
        raise PlanError(f"{where} is a {' '.join(shape)} slice and TPUSyncPool {theirs.name} a {theirs.tpu.tpu_type} "
                        f"{theirs.tpu.topology} slice: spec.kvTransfer.connector {spec.kv_transfer.connector} pairs "
                        f"prefill and decode hosts by rank and needs one slice shape on both roles; connector "
                        f"tpusync reshards on load")


# Role args that change the bytes or the meaning of the KV blocks a role stores: prefill and decode
# must agree on them, or decode would load KV it cannot read. (Page size and parallelism may differ:
# the tpusync connectors regroup and reshard on load.)
_KV_LAYOUT_OPTIONS = {
    "vllm-tpu": {"--dtype", "--kv-cache-dtype", "--quantization", "--hf-overrides"},
    "sglang-jax": {"--dtype", "--kv-cache-dtype", "--quantization"},
    "reference": {"--model-config", "--hash-seed"},
}
_SHORT_OPTIONS = {"-q": "--quantization"}
# Reference engine ModelConfig fields that only size or schedule the cache.
_REFERENCE_LAYOUT_FREE = {"page_size", "chunk", "max_seq"}


def option_values(args: list[str]) -> dict[str, str]:
    """Each option's last value in `args`, read as the engines' parsers read them (--a_b=v and
    --a-b v alike; a flag without a value is "true")."""
    out: dict[str, str] = {}
    for i, arg in enumerate(args):
        name = _SHORT_OPTIONS.get(arg.split("=", 1)[0]) or _long_option(arg)
        if not name:
            continue
        if "=" in arg:
            out[name] = arg.split("=", 1)[1]
        elif i + 1 < len(args) and not args[i + 1].startswith("-"):
            out[name] = args[i + 1]
        else:
            out[name] = "true"
    return out


def _layout_value(engine: str, option: str, value: str | None) -> Any:
    if engine == "reference" and option == "--model-config" and value is not None:
        try:
            fields = json.loads(value)
        except ValueError:
            return value
        if isinstance(fields, dict):
            return {k: v for k, v in fields.items() if k not in _REFERENCE_LAYOUT_FREE}
    return value


def check_kv_layout_args(spec: DisaggregatedServingSpec) -> None:
    """An incompatible pair is refused before it runs: role args that make prefill and decode store
    KV of another dtype, quantization or model shape."""
    engine = spec.engine.type
    prefill, decode = option_values(spec.prefill.args or []), option_values(spec.decode.args or [])
    for option in sorted(_KV_LAYOUT_OPTIONS[engine]):
        p, d = prefill.get(option), decode.get(option)
        if _layout_value(engine, option, p) != _layout_value(engine, option, d):
            raise PlanError(f"spec.decode.args: {option} {_shown(d)} differs from spec.prefill.args' {_shown(p)}: "
                            f"decode loads the KV blocks prefill stores, so both roles must set it alike")


def _shown(value: str | None) -> str:
    return "(unset)" if value is None else value


def plan_roles(spec: DisaggregatedServingSpec, pool: PoolInfo,
               role_pools: dict[str, PoolInfo] | None = None) -> list[RolePlan]:
    """`role_pools`: the pool of each role with a spec.<role>.poolRef of its own; the others run on `pool`."""
    pools = {role: (role_pools or {}).get(role, pool) for role in ROLES}
    check_role_pools(spec, pools)
    plans = []
    for role in ROLES:
        r, rp = spec.role(role), pools[role]
        if spec.engine.cpu_only:
            hosts, chips = r.hosts_per_replica or 1, 0
        else:
            topology = r.topology or rp.tpu.topology
            if topology != rp.tpu.topology:
                ref = f"spec.{role}.poolRef" if r.pool_ref is not None else "spec.poolRef"
                raise PlanError(f"spec.{role}.topology {topology} does not match the topology {rp.tpu.topology} of "
                                f"{ref} (TPUSyncPool {rp.name}): one node pool has one slice shape")
            hosts, chips = rp.tpu.hosts, rp.tpu.chips_per_host
            if r.hosts_per_replica is not None and r.hosts_per_replica != hosts:
                raise PlanError(f"spec.{role}.hostsPerReplica must be {hosts} for topology {topology}")
            if hosts > 1 and spec.engine.type == "sglang-jax":
                raise PlanError(f"{SGLANG_SINGLE_HOST}; TPUSyncPool {rp.name}'s topology {topology} has {hosts} "
                                f"hosts per slice")
        # Lockstep: every role is a LeaderWorkerSet of the serving's DisaggregatedSet.
        kind = "LeaderWorkerSet" if hosts > 1 or spec.rollout.strategy == "Lockstep" else "Deployment"
        peers = tuple(p for other, p in pools.items() if other != role and p.name != rp.name)
        plans.append(RolePlan(role=role, replicas=role_replicas(spec, role), hosts_per_replica=hosts,
                              chips_per_host=chips, kind=kind, pool=rp, peer_pools=peers))
    return plans


def capacity_shortfall(roles: list[RolePlan]) -> str | None:
    """Why a role's pool cannot hold every TPU replica of the serving on it at once, or None.
    Each replica takes whole hosts (a multi-host replica a whole slice)."""
    for name in dict.fromkeys(r.pool.name for r in roles):
        on = [r for r in roles if r.pool.name == name and r.chips_per_host]
        if not on:
            continue
        pool = on[0].pool
        need = sum(r.replicas * r.hosts_per_replica for r in on)
        have, _ = pool_hosts(pool.spec, pool.tpu)
        if need <= have:
            continue
        parts = " + ".join(f"{r.role} {r.replicas} x {r.hosts_per_replica}" for r in on)
        fields = "/".join(f"spec.{r.role}" for r in on)
        hint = (f" (each multi-host replica takes a whole slice of {pool.tpu.hosts} hosts: raise the pool's "
                f"spec.capacity.hosts by {pool.tpu.hosts} per slice)" if pool.tpu.multi_host else "")
        return (f"{fields} need {need} TPU hosts ({parts}) but TPUSyncPool {pool.name} has {have}{hint}; the "
                f"replicas that do not fit stay Pending")
    return None


def _long_option(arg: str) -> str:
    """An argument's option name as vLLM's parser reads it ('--max_model_len=1' is --max-model-len)."""
    return arg.split("=", 1)[0].replace("_", "-") if arg.startswith("--") else ""


# Options the operator renders from spec.model for vLLM, so that it can check them; role args must
# not set them again (vLLM takes the last of a repeated option).
_LENGTH_OPTIONS = {"--max-model-len": "spec.model.maxModelLen, which the operator checks against the model's "
                                      "length"}


def check_model_length(spec: DisaggregatedServingSpec) -> None:
    """The context length the engines get is one the model serves (vLLM exits at start-up
    otherwise): spec.model.maxModelLen within maxPositionEmbeddings, or within what ropeScaling
    makes of the model's pretrained length. The model-level rules are CEL too."""
    m = spec.model
    if (m.max_model_len is not None or m.rope_scaling is not None) and spec.engine.type != "vllm-tpu":
        raise PlanError(LENGTH_NEEDS_VLLM)
    if spec.engine.type == "vllm-tpu":
        owned = dict(_LENGTH_OPTIONS)
        if m.rope_scaling is not None:
            owned["--hf-overrides"] = "spec.model.ropeScaling (rendered as vLLM's --hf-overrides)"
        for role in ROLES:
            for arg in spec.role(role).args or []:
                if _long_option(arg) in owned:
                    raise PlanError(f"spec.{role}.args: {_long_option(arg)} is set by {owned[_long_option(arg)]}: "
                                    f"give it there, not in the args")
    if m.max_model_len is None:
        return
    if m.rope_scaling is not None:
        scaled = m.rope_scaling.original_max_position_embeddings * m.rope_scaling.factor
        if m.max_model_len > scaled:
            raise PlanError(f"{MAX_MODEL_LEN_BEYOND_SCALING} ({m.max_model_len} > "
                            f"{m.rope_scaling.original_max_position_embeddings} x {m.rope_scaling.factor:g})")
    elif m.max_position_embeddings is None:
        raise PlanError(MAX_MODEL_LEN_UNDECLARED)
    elif m.max_model_len > m.max_position_embeddings:
        raise PlanError(f"{MAX_MODEL_LEN_TOO_LONG} ({m.max_model_len} > {m.max_position_embeddings})")


def check_engine_security(spec: DisaggregatedServingSpec) -> None:
    """What the API server or the kubelet would refuse for the engine container of
    spec.engine.securityContext over the operator's default (CEL too)."""
    sc = spec.engine.security_context
    if sc is None:
        return
    if sc.privileged and not sc.allow_privilege_escalation:
        raise PlanError(ENGINE_PRIVILEGED_ESCALATION)
    uid = sc.run_as_user if sc.run_as_user is not None else (None if spec.engine.cpu_only else 0)
    if sc.run_as_non_root and uid == 0:
        raise PlanError(ENGINE_NONROOT_UID)


# A DisaggregatedSet names its LeaderWorkerSets <set>-<8-character revision>-<role>; LWS names
# each group's StatefulSet <lws>-<group> and labels its pods controller-revision-hash
# <statefulset>-<10 characters>, a label value of at most 63.
LOCKSTEP_NAME_MAX = 63 - 11 - len("-00") - len("-12345678-prefill")


def check_lockstep(owner: Owner, spec: DisaggregatedServingSpec) -> None:
    if spec.prefill.replicas == 0 or spec.decode.replicas == 0:     # the schema refuses it too
        raise PlanError(LOCKSTEP_NEEDS_BOTH_ROLES)
    if len(owner.name) > LOCKSTEP_NAME_MAX:
        raise PlanError(f"metadata.name: at most {LOCKSTEP_NAME_MAX} characters with spec.rollout.strategy "
                        f"Lockstep (its LeaderWorkerSets are <name>-<revision>-<role>, and the names LWS derives "
                        f"from them must stay within 63), not {len(owner.name)}")


def plan_serving(owner: Owner, spec: DisaggregatedServingSpec, pool: PoolInfo, available_kinds: set[str],
                 role_pools: dict[str, PoolInfo] | None = None) -> ServingPlan:
    """available_kinds: the optional kinds (OPTIONAL_KINDS) served by the cluster; role_pools: the
    pool of each role with a spec.<role>.poolRef of its own (spec.poolRef's `pool` runs the others)."""
    if spec.engine.type == "sglang-jax" and not spec.engine.image:     # the schema rejects it too
        raise PlanError(SGLANG_IMAGE_REQUIRED)
    if spec.model.uri.startswith("gs://") and spec.engine.type != "vllm-tpu":    # so does this
        raise PlanError(GS_NEEDS_VLLM)
    if spec.model.revision and spec.engine.type == "reference":                  # and this
        raise PlanError(REVISION_NEEDS_WEIGHTS)
    check_model_length(spec)
    check_engine_security(spec)
    if spec.prefill.pool_ref is not None and spec.decode.pool_ref is not None:       # the schema refuses it too
        raise PlanError(ROLE_POOLS_BOTH)
    check_kv_layout_args(spec)
    lockstep = spec.rollout.strategy == "Lockstep"
    if lockstep:
        check_lockstep(owner, spec)
    roles = plan_roles(spec, pool, role_pools)
    required: set[str] = {p.kind for p in roles if p.kind == "LeaderWorkerSet"}
    if lockstep:
        required.add("DisaggregatedSet")
    if spec.routing.enabled:
        required |= {"InferencePool", "InferenceObjective"}
        if spec.routing.gateway_ref is not None:
            required.add("HTTPRoute")
        if spec.routing.gke_gateway_policies:
            required |= set(GKE_POLICY_KINDS)
    missing = sorted(required - available_kinds)
    apply: list[Child] = []
    delete: list[Ref] = []
    if lockstep and not {"DisaggregatedSet", "LeaderWorkerSet"} & set(missing):
        apply.append(serving_builders.build_disaggregated_set(owner, spec, roles))
    elif not lockstep and "DisaggregatedSet" in available_kinds:
        delete.append(Ref(OPTIONAL_KINDS["DisaggregatedSet"][0], "DisaggregatedSet",
                          names.disaggregated_set(owner.name)))
    for p in roles:
        name = names.role(owner.name, p.role)
        if lockstep:      # the DisaggregatedSet's LeaderWorkerSets replace the role's own workload
            apply.append(serving_builders.build_role_service(owner, spec, p.role))
            delete.append(Ref("apps/v1", "Deployment", name))
            if "LeaderWorkerSet" in available_kinds:
                delete.append(Ref(OPTIONAL_KINDS["LeaderWorkerSet"][0], "LeaderWorkerSet", name))
            continue
        if p.kind in missing:
            continue
        apply.append(serving_builders.build_role_workload(owner, spec, p))
        apply.append(serving_builders.build_role_service(owner, spec, p.role))
        if p.kind == "Deployment" and "LeaderWorkerSet" in available_kinds:
            delete.append(Ref(OPTIONAL_KINDS["LeaderWorkerSet"][0], "LeaderWorkerSet", name))
        elif p.kind == "LeaderWorkerSet":
            delete.append(Ref("apps/v1", "Deployment", name))
    apply.append(serving_builders.build_serving_network_policy(owner, spec))
    if spec.engine.type == "sglang-jax":     # spec.engine.type is immutable: nothing to prune
        apply += [sglang_pd.build_bootstrap_deployment(owner, spec),
                  sglang_pd.build_bootstrap_service(owner)]
    epp = names.epp(owner.name)
    epp_children = [Ref("apps/v1", "Deployment", epp), Ref("v1", "Service", epp), Ref("v1", "ConfigMap", epp),
                    Ref("rbac.authorization.k8s.io/v1", "RoleBinding", epp),
                    Ref("rbac.authorization.k8s.io/v1", "Role", epp), Ref("v1", "ServiceAccount", epp),
                    Ref("networking.k8s.io/v1", "NetworkPolicy", epp)]
    if llmd.epp_disruption_budget_wanted(spec):
        apply.append(llmd.build_epp_disruption_budget(owner))
    else:
        delete.append(Ref("policy/v1", "PodDisruptionBudget", epp))
    if spec.routing.enabled:
        events_port = roles[0].pool.spec.sidecar.kv_events_port    # one port: check_role_pools
        apply += [llmd.build_epp_service_account(owner), llmd.build_epp_role(owner, spec),
                  llmd.build_epp_role_binding(owner), llmd.build_epp_config_map(owner, spec, events_port),
                  llmd.build_epp_deployment(owner, spec, events_port), llmd.build_epp_service(owner),
                  llmd.build_epp_network_policy(owner)]
        if "InferencePool" not in missing:
            apply.append(llmd.build_inference_pool(owner, spec))
        if "InferenceObjective" not in missing:
            apply.append(llmd.build_inference_objective(owner, spec))
        if spec.routing.gateway_ref is not None and "HTTPRoute" not in missing:
            apply.append(llmd.build_http_route(owner, spec))
        if spec.routing.gke_gateway_policies:
            if "HealthCheckPolicy" not in missing:
                apply.append(llmd.build_gke_health_check_policy(owner, spec))
            if "GCPBackendPolicy" not in missing:
                apply.append(llmd.build_gke_backend_policy(owner))
    else:
        delete += epp_children
    for kind in ("InferencePool", "InferenceObjective", "HTTPRoute", *GKE_POLICY_KINDS):
        wanted = spec.routing.enabled and (
            spec.routing.gateway_ref is not None if kind == "HTTPRoute"
            else spec.routing.gke_gateway_policies if kind in GKE_POLICY_KINDS else True)
        if not wanted and kind in available_kinds:
            delete.append(Ref(OPTIONAL_KINDS[kind][0], kind, owner.name))
    return ServingPlan(roles=roles, apply=apply, delete=delete, missing_kinds=missing,
                       required_kinds=sorted(required))
