"""Status computation (pure): conditions Ready / Progressing / Degraded with reason, message,
observedGeneration and a lastTransitionTime that changes only when the status changes.
The clock is passed in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .builders.common import DISK_ANNOTATION, DRAM_ANNOTATION
from .builders.sidecar import CONTAINER_NAME

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    return datetime.now(UTC)


def _ts(now: datetime) -> str:
    return now.astimezone(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Cond:
    type: str
    status: bool | None          # None: Unknown
    reason: str
    message: str = ""


def merge_conditions(old: list[dict[str, Any]] | None, new: list[Cond], generation: int | None,
                     now: datetime) -> list[dict[str, Any]]:
    """New condition dicts; lastTransitionTime is kept from `old` when the status is unchanged."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        status = "Unknown" if c.status is None else "True" if c.status else "False"
        prior = previous.get(c.type)
        changed = prior is None or prior.get("status") != status
        out.append({
            "type": c.type, "status": status, "reason": c.reason, "message": c.message,
            "observedGeneration": generation,
            "lastTransitionTime": prior["lastTransitionTime"]
            if prior is not None and not changed and "lastTransitionTime" in prior else _ts(now),
        })
    return out


def transitions(old: list[dict[str, Any]] | None, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Conditions whose status or reason changed (for events): Degraded staying True for a new
    cause (an API error, then a missing CRD) is news too."""
    previous = {c.get("type"): (c.get("status"), c.get("reason")) for c in old or []}
    return [c for c in new if previous.get(c["type"]) != (c["status"], c.get("reason"))]


def three(ready: Cond, progressing: Cond, degraded: Cond) -> list[Cond]:
    return [ready, progressing, degraded]


# Degraded reasons of a pass that could not observe: a request failed.
API_ERROR = "APIError"          # Kubernetes API: 5xx, 429, a timeout, a reset connection; retried soon
REJECTED = "ApplyFailed"        # Kubernetes API: 400, 403, 422, the request itself is refused
GKE_API_ERROR = "GKEAPIError"   # GKE API: 5xx, 429, a timeout; retried soon
# A GKE node pool of a wanted name exists without the operator's mark: never adopted, resized
# or deleted (pool_plan.node_pool_step).
NODE_POOL_NOT_OWNED = "NodePoolNotOwned"
# A child's name is held by an object the operator does not own (ownership.py): the pass
# writes nothing until it is free.
NAME_CONFLICT = "NameConflict"


def held_conditions(old: list[dict[str, Any]] | None, causes: list[Cond], generation: int | None,
                    now: datetime) -> list[dict[str, Any]]:
    """Conditions of a pass that could not observe (causes[0]: the request that failed; then
    any other issue): nothing new is known, so Ready and Progressing stay exactly as last
    written (their observedGeneration says for which spec) and Degraded names the causes.
    Before anything was ever observed, Ready and Progressing are Unknown."""
    previous = {c.get("type"): c for c in old or []}
    failure = causes[0]
    degraded = Cond("Degraded", True, failure.reason, "; ".join(c.message for c in causes if c.status))
    out = []
    for type_ in ("Ready", "Progressing"):
        if type_ in previous:
            out.append(dict(previous[type_]))
        else:
            out += merge_conditions(None, [Cond(type_, None, failure.reason, failure.message)], generation, now)
    return out + merge_conditions(old, [degraded], generation, now)


# ------------------------------------------------------------------ pool

def node_ready(node: dict[str, Any]) -> bool:
    for c in node.get("status", {}).get("conditions", []) or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True" and not node.get("spec", {}).get("unschedulable", False)
    return False


def pod_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True (every container ready: it receives Service traffic)."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def sidecar_ready(pod: dict[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    statuses = (pod.get("status", {}).get("initContainerStatuses") or []) + \
               (pod.get("status", {}).get("containerStatuses") or [])
    return any(s.get("name") == CONTAINER_NAME and s.get("ready") for s in statuses)


@dataclass(frozen=True)
class Capacity:
    sidecars: int
    ready_sidecars: int
    dram_bytes: int
    disk_bytes: int


def pool_capacity(pods: list[dict[str, Any]]) -> Capacity:
    """Sum the DRAM and disk that ready sidecars lend (from their pod annotations)."""
    ready = [p for p in pods if sidecar_ready(p)]

    def total(key: str) -> int:
        return sum(int(p.get("metadata", {}).get("annotations", {}).get(key, "0") or 0) for p in ready)

    return Capacity(len(pods), len(ready), total(DRAM_ANNOTATION), total(DISK_ANNOTATION))


@dataclass
class PoolObservation:
    mode: str
    desired_hosts: int
    min_ready_hosts: int
    ready_hosts: int
    capacity: Capacity
    store_desired: int               # -1: DaemonSet (desiredNumberScheduled given separately)
    store_ready: int
    node_pool_state: str | None = None
    node_pool_ready: bool = True
    node_pool_message: str = ""
    node_pool_updating: str = ""     # a resize / autoscaling change in flight: Progressing, still Ready
    issues: list[Cond] = field(default_factory=list)   # Degraded causes, first one wins the reason


def pool_conditions(o: PoolObservation) -> list[Cond]:
    blocking = [i for i in o.issues if i.status]
    # What the operator will not touch (a node pool, an object at a child's name) makes no
    # progress: Ready says why, first. A node pool not its own is not provisioning either.
    stalled = next((i for i in blocking if i.reason in _STALLS), None)
    provisioning = o.mode == "gke" and not o.node_pool_ready and \
        not any(i.reason == NODE_POOL_NOT_OWNED for i in blocking)
    progressing: list[str] = []
    if provisioning:
        progressing.append(o.node_pool_message or f"node pool is {o.node_pool_state}")
    if o.ready_hosts < o.min_ready_hosts:
        progressing.append(f"{o.ready_hosts}/{o.min_ready_hosts} hosts ready")
    if o.store_desired != 0 and o.store_ready < max(o.store_desired, 1):
        progressing.append(f"{o.store_ready}/{max(o.store_desired, 1)} store nodes ready")
    if blocking:
        degraded = Cond("Degraded", True, blocking[0].reason, "; ".join(i.message for i in blocking))
    else:
        degraded = Cond("Degraded", False, "AsExpected")
    updating = [o.node_pool_updating] if o.node_pool_updating else []
    stable = f"{o.ready_hosts} hosts, {o.capacity.ready_sidecars} sidecars ready"
    if progressing:
        reason = "NodePoolProvisioning" if provisioning \
            else "HostsNotReady" if o.ready_hosts < o.min_ready_hosts else "StoreNodesNotReady"
        prog = Cond("Progressing", True, reason, "; ".join(updating + progressing))
    elif updating:
        prog = Cond("Progressing", True, "NodePoolUpdating", updating[0])
    else:
        prog = Cond("Progressing", False, "Stable", stable)
    ready_ok = not progressing and not any(i.reason in _BLOCKS_READY for i in blocking)
    if ready_ok:
        ready = Cond("Ready", True, "PoolReady", stable)
    elif stalled is not None:
        ready = Cond("Ready", False, stalled.reason, stalled.message)
    elif progressing:
        ready = Cond("Ready", False, prog.reason, prog.message)
    else:
        ready = Cond("Ready", False, degraded.reason, degraded.message)
    return three(ready, prog, degraded)


_STALLS = {NODE_POOL_NOT_OWNED, NAME_CONFLICT}
_BLOCKS_READY = {"AuthSecretMissing", "NodePoolError", "NodePoolOperationFailed", "InvalidSpec", "GKEAuthFailed",
                 *_STALLS}


# ---------------------------------------------------------------- serving

@dataclass
class RoleObservation:
    role: str
    kind: str
    replicas: int
    ready_replicas: int


@dataclass(frozen=True)
class RevisionObservation:
    """One revision of a Lockstep serving's DisaggregatedSet: its LeaderWorkerSets' replicas and
    ready replicas by role."""
    revision: str
    created: str
    replicas: dict[str, int]
    ready: dict[str, int]

    def servable(self, roles: tuple[str, ...] = ("prefill", "decode")) -> bool:
        """Requests can reach it: a ready replica of every role (what the rollout screener asks)."""
        return all(self.ready.get(r, 0) > 0 for r in roles)

    def describe(self) -> str:
        return ", ".join(f"{r} {self.ready.get(r, 0)}/{self.replicas.get(r, 0)} ready" for r in ("prefill", "decode"))


def revisions_of(workloads: list[dict[str, Any]], revision_label: str, role_label: str) -> list[RevisionObservation]:
    """The revisions of a DisaggregatedSet from its LeaderWorkerSets, newest first: a rollout
    creates the new revision's sets while the older ones drain."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for w in workloads:
        rev = (w["metadata"].get("labels") or {}).get(revision_label)
        if rev:
            groups.setdefault(rev, []).append(w)
    out = []
    for rev, ws in groups.items():
        replicas: dict[str, int] = {}
        ready: dict[str, int] = {}
        for w in ws:
            role = (w["metadata"].get("labels") or {}).get(role_label, "")
            replicas[role] = replicas.get(role, 0) + int((w.get("spec") or {}).get("replicas", 1) or 0)
            ready[role] = ready.get(role, 0) + workload_ready_replicas(w)
        created = min(str(w["metadata"].get("creationTimestamp", "")) for w in ws)
        out.append(RevisionObservation(rev, created, replicas, ready))
    return sorted(out, key=lambda r: (r.created, r.revision), reverse=True)


@dataclass
class ServingObservation:
    roles: list[RoleObservation]
    routing_enabled: bool
    routing_ready: bool
    pool_ready: bool
    missing_kinds_message: str = ""
    issues: list[Cond] = field(default_factory=list)
    pd_bootstrap_ready: bool = True     # sglang-jax's registry (always true for other engines)
    revisions: list[RevisionObservation] = field(default_factory=list)    # Lockstep servings, newest first


def serving_conditions(o: ServingObservation) -> list[Cond]:
    waiting = [f"{r.role} {r.ready_replicas}/{r.replicas} ready" for r in o.roles if r.ready_replicas < r.replicas]
    rolling = len(o.revisions) > 1
    if rolling:
        new, *old = o.revisions
        waiting = [f"lockstep rollout to revision {new.revision} ({new.describe()}); draining "
                   + "; ".join(f"revision {r.revision} ({r.describe()})" for r in old)]
    if o.routing_enabled and not o.routing_ready:
        waiting.append("routing not ready")
    if not o.pd_bootstrap_ready:
        waiting.append("sglang-jax P/D bootstrap not ready")
    issues = list(o.issues)
    if o.missing_kinds_message:
        issues.insert(0, Cond("Degraded", True, "MissingCRD", o.missing_kinds_message))
    if not o.pool_ready:
        waiting.append("TPUSyncPool not ready")
    degraded = (Cond("Degraded", True, issues[0].reason, "; ".join(i.message for i in issues)) if issues
                else Cond("Degraded", False, "AsExpected"))
    prog = (Cond("Progressing", True, "LockstepRollout" if rolling else "RolloutInProgress", "; ".join(waiting))
            if waiting else Cond("Progressing", False, "Stable", "all roles ready"))
    # A lockstep rollout keeps serving while some revision has both roles ready: the router
    # sends each request to one such revision.
    servable = rolling and any(r.servable() for r in o.revisions) and \
        (not o.routing_enabled or o.routing_ready) and o.pool_ready and o.pd_bootstrap_ready
    ok = (not waiting or servable) and not issues
    ready = Cond("Ready", ok, "ServingReady" if ok else (degraded.reason if issues else prog.reason),
                 ("serving while it rolls: " + prog.message if servable else "all roles ready") if ok
                 else (degraded.message if issues else prog.message))
    return three(ready, prog, degraded)


def workload_ready_replicas(obj: dict[str, Any] | None) -> int:
    """Ready replicas of a Deployment or LeaderWorkerSet (groups), 0 when absent."""
    if not obj:
        return 0
    return int(obj.get("status", {}).get("readyReplicas", 0) or 0)
