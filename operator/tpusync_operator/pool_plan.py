"""A TPUSyncPool's plan, pure: from its spec to the children to apply and delete and the GKE
node pool requests (`plan_pool`), and from a node pool's observed state to the one GKE call
to make next (`node_pool_step`). No I/O; reconcile_pool and nodepools execute the plans.

`PoolPlan` holds the children to server-side apply (Kubernetes objects, as the builders
render them) and `Ref`s of the children to delete; `NodePoolStep` says which one call
(`NodePoolAction`) to make to GKE next, if any, with what it needs. Invariants: a plan only
names children of its owner; at most one GKE call per node pool per pass (none while an
operation runs). `PlanError`, `Child` and `Ref` are serving_plan's too."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .builders import names
from .builders import pool as pool_builders
from .builders.common import Owner
from .models import GKE_NODE_POOL_MAX, QUEUED_PROVISIONING_UNSUPPORTED, TPUSyncPoolSpec
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
    gke = spec.provisioning.gke if spec.provisioning.mode == "gke" else None
    if gke is not None and gke.queued_provisioning:       # the schema refuses it too
        raise PlanError(QUEUED_PROVISIONING_UNSUPPORTED)
    if not tpu.multi_host:
        return tpu
    if gke is not None and tpu.tpu_type == "v7x" and not gke.workload_policy:
        raise PlanError(f"spec.provisioning.gke.workloadPolicy is required for the v7x multi-host "
                        f"topology {tpu.topology} ({tpu.hosts} hosts)")
    # A multi-host slice's hosts come and go together, in mode existing as in mode gke.
    whole = (f"each slice is its own GKE node pool of {tpu.hosts} hosts" if gke is not None else
             f"the hosts of a multi-host slice come and go together, and each multi-host replica takes a whole "
             f"slice of {tpu.hosts} hosts")
    if cap.hosts is not None and cap.hosts % tpu.hosts:
        raise PlanError(f"spec.capacity.hosts must be a multiple of {tpu.hosts} for topology {tpu.topology}: {whole}")
    if cap.autoscaling is not None and (cap.autoscaling.min_hosts % tpu.hosts
                                        or cap.autoscaling.max_hosts % tpu.hosts):
        scaled = (f"each slice is its own GKE node pool, which GKE's autoscaler scales atomically between 0 and "
                  f"{tpu.hosts} hosts" if gke is not None else whole)
        raise PlanError(f"spec.capacity.autoscaling: minHosts and maxHosts must be multiples of {tpu.hosts} "
                        f"for topology {tpu.topology}: {scaled}")
    return tpu


def pool_hosts(spec: TPUSyncPoolSpec, tpu: Slice) -> tuple[int, int]:
    """(desired hosts, fewest ready hosts that count as Ready) of a pool."""
    cap = spec.capacity
    if cap.autoscaling is not None:
        return cap.autoscaling.max_hosts, cap.autoscaling.min_hosts
    hosts = cap.hosts if cap.hosts is not None else tpu.hosts
    return hosts, hosts


SHARED_CAPACITY_BEYOND_CLAIM = "SharedCapacityBeyondClaim"


def shared_claim_problem(spec: TPUSyncPoolSpec, claim: dict[str, Any] | None) -> str | None:
    """Why spec.tiers.shared.capacity cannot hold on the claim of spec.tiers.shared.claimName (read
    at reconcile: its size, the bound volume's when bound, else its request), or None."""
    shared = spec.tiers.shared
    if shared is None or shared.claim_name is None or shared.capacity is None or claim is None:
        return None
    size = (claim.get("status", {}).get("capacity", {}).get("storage")
            or claim.get("spec", {}).get("resources", {}).get("requests", {}).get("storage"))
    try:
        beyond = size is not None and to_bytes(shared.capacity) > to_bytes(str(size))
    except ValueError:    # a quantity form byte sizes do not use: not compared
        return None
    if not beyond:
        return None
    return (f"spec.tiers.shared.capacity {shared.capacity} exceeds the {size} of PersistentVolumeClaim "
            f"{shared.claim_name} (spec.tiers.shared.claimName): the tier's evictor would let it fill the volume; "
            f"lower spec.tiers.shared.capacity, or leave it empty for the whole volume")


def check_pool_name(name: str, spec: TPUSyncPoolSpec) -> None:
    """Every child's name derives from the pool's within Kubernetes' limits (the schema refuses it too)."""
    store = spec.store_nodes.enabled and spec.store_nodes.kind == "StatefulSet"
    limit = names.pool_name_max(store_statefulset=store)
    if len(name) > limit:
        child = (f"StatefulSet {names.pool_store(name)}, at most {names.STATEFULSET_MAX}" if store else
                 f"Service {names.pool_peers(name)}, at most {names.LABEL_MAX}")
        raise PlanError(f"metadata.name: at most {limit} characters for this pool, not {len(name)}: its {child} "
                        f"characters, derives its name from it")


def check_node_pool_names(name: str, spec: TPUSyncPoolSpec, tpu: Slice) -> None:
    """In mode gke, every slice's node pool name within GKE's limit (slice 0 the schema checks too)."""
    if spec.provisioning.mode != "gke":
        return
    slices = pool_builders.gke_slices(spec, tpu)
    longest = names.gke_node_pool(name, spec, slices - 1)
    if len(longest) > GKE_NODE_POOL_MAX:
        gke = spec.provisioning.gke
        field = "spec.provisioning.gke.nodePoolName" if gke and gke.node_pool_name else \
            "metadata.name (the default of spec.provisioning.gke.nodePoolName)"
        raise PlanError(f"{field}: the GKE node pool {longest} of slice {slices - 1} has {len(longest)} characters; "
                        f"GKE allows {GKE_NODE_POOL_MAX}: shorten it, or set spec.provisioning.gke.nodePoolName")


def plan_pool(owner: Owner, spec: TPUSyncPoolSpec) -> PoolPlan:
    tpu = check_pool(spec)
    check_pool_name(owner.name, spec)
    check_node_pool_names(owner.name, spec, tpu)
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
