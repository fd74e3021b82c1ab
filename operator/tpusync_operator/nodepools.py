"""A TPUSyncPool's GKE node pools (mode gke): executing pool_plan's `NodePoolStep` for each
slice's node pool (at most one GKE call per pass, none while an operation runs), deleting the
node pools of slices the spec dropped, and the finalizer that deletes them all. Only node
pools carrying the pool's mark (`node_pool_mark`: the operator created them for it) are ever
changed or deleted; another node pool of a wanted name is reported and left alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kopf

from .builders import names
from .builders.common import Owner
from .builders.pool import node_pool_mark, node_pool_marked
from .gke import ClusterRef, GKEAuthError, GKEClient, GKEConflict, GKEError, GKETransientError
from .models import TPUSyncPoolSpec
from .pool_plan import (
    NodePoolAction,
    NodePoolRequest,
    PlanError,
    PoolPlan,
    mark_text,
    node_pool_step,
    plan_pool,
)
from .reconcile import Deps, Pass
from .status import GKE_API_ERROR, NODE_POOL_NOT_OWNED, Cond


@dataclass(frozen=True)
class NodePoolReport:
    """What a pass found and did about one node pool."""
    entry: dict[str, Any]   # its status.nodePools entry: name, state, operation, nodeCount
    ready: bool
    message: str            # why it is not ready ("" when it is)
    updating: str = ""      # an edit in flight on a serving node pool ("" when none)


@dataclass(frozen=True)
class NodePoolsReport:
    """What a pass found and did about all of a pool's node pools."""
    entries: list[dict[str, Any]]   # status.nodePools
    ready: bool                     # every slice's node pool is ready
    message: str                    # the first reason one is not
    updating: str                   # the first edit in flight


def recorded_node_pools(old: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """status.nodePools by name (status.nodePool alone in a status from an older operator)."""
    entries = old.get("nodePools") or ([old["nodePool"]] if old.get("nodePool") else [])
    return {e["name"]: e for e in entries if e.get("name")}


async def reconcile_node_pools(deps: Deps, p: Pass, owner: Owner, spec: TPUSyncPoolSpec, plan: PoolPlan,
                               old: dict[str, Any]) -> NodePoolsReport:
    """The GKE step for every slice's node pool, then the deletion of node pools of slices
    the spec no longer has."""
    gke = spec.provisioning.gke
    assert gke is not None and deps.gke is not None and plan.node_pool_requests
    cluster = ClusterRef(gke.project, gke.location, gke.cluster)
    client = deps.gke
    mark = node_pool_mark(owner)
    recorded = recorded_node_pools(old)
    entries: list[dict[str, Any]] = []
    ready, message, updating = True, "", ""
    for request in plan.node_pool_requests:
        name = request.name
        # GKE runs one operation per cluster: start none while another is in flight.
        idle = not any(e.get("operation") for e in entries) and \
            not any(e.get("operation") for n, e in recorded.items() if n != name)
        report = await _node_pool(p, client, cluster, request, recorded.get(name, {}),
                                  plan.tpu.multi_host, may_start=idle)
        entries.append(report.entry)
        ready = ready and report.ready
        message = message or ("" if report.ready else report.message)
        updating = updating or report.updating
    for name in sorted(set(recorded) - {e["name"] for e in entries}):   # slices the spec dropped
        gone, op_name = False, recorded[name].get("operation")
        try:
            op = await client.get_operation(cluster, op_name) if op_name else None
            busy = any(e.get("operation") for e in entries)
            if (op is None and not busy) or (op is not None and op.get("status") == "DONE"):
                if (op or {}).get("error"):
                    p.issue("NodePoolOperationFailed", f"deleting node pool {name}: {(op or {})['error']}; retrying")
                gone, op_name = await _delete_node_pool(client, cluster, name, mark, p.event)
        except GKEConflict as e:
            p.again(15, f"node pool {name}: {e.message}")
        except GKEError as e:
            p.issue("GKEError", f"deleting node pool {name}: {e}", retry=60)
        if not gone:
            entries.append({"name": name, "state": "STOPPING", "operation": op_name, "nodeCount": None})
            p.again(15, f"waiting for GKE node pool {name} to be deleted")
    return NodePoolsReport(entries, ready, message, updating)


async def _node_pool(p: Pass, client: GKEClient, cluster: ClusterRef, request: NodePoolRequest,
                     recorded: dict[str, Any], multi_host: bool, may_start: bool = True) -> NodePoolReport:
    """One node pool: at most one call that changes it (create, setSize or setAutoscaling)
    per pass, none while the operation recorded in status runs (or, without `may_start`,
    one on another node pool)."""
    name = request.name
    op_name, node_count = recorded.get("operation"), recorded.get("nodeCount")

    def unknown(message: str, state: str = "Unknown") -> NodePoolReport:
        return NodePoolReport({"name": name, "state": state, "operation": op_name, "nodeCount": node_count},
                              False, message)

    try:
        op = await client.get_operation(cluster, op_name) if op_name else None
        observed = await client.get_node_pool(cluster, name)
        step = node_pool_step(request.body, op, observed, node_count=node_count, multi_host=multi_host)
        pending = op_name if op is not None and op.get("status") != "DONE" else None
        updating = step.message if step.updating else ""
        try:
            if step.action.calls_gke and not may_start:
                p.again(15, f"node pool {name}: waiting for another node pool's operation")
                return NodePoolReport({"name": name, "state": step.state, "operation": None,
                                       "nodeCount": recorded.get("nodeCount")}, step.ready, step.message, updating)
            started: dict[str, Any] | None = None
            if step.action is NodePoolAction.CREATE:
                started = await client.create_node_pool(cluster, request.body)
                p.event("Normal", "NodePoolCreating",
                        f"creating GKE node pool {name} (operation {started.get('name')})")
            elif step.action is NodePoolAction.SET_SIZE:
                assert step.node_count is not None
                started = await client.set_node_pool_size(cluster, name, step.node_count)
                p.event("Normal", "NodePoolResizing", f"{step.message} (operation {started.get('name')})")
            elif step.action is NodePoolAction.SET_AUTOSCALING:
                assert step.autoscaling is not None
                started = await client.set_node_pool_autoscaling(cluster, name, step.autoscaling)
                p.event("Normal", "NodePoolAutoscalingChanged", f"{step.message} (operation {started.get('name')})")
            if started is not None:
                pending = started.get("name")
            node_count = step.node_count
        except GKEConflict as e:
            # Exists already, or another operation runs on the cluster: observe again soon.
            p.again(15, f"node pool {name}: {e.message}")
            if step.updating:
                updating = f"{step.message}: GKE is busy ({e.message}); retrying"
        if step.degraded_reason:
            p.issue(step.degraded_reason, step.message)
        if not step.ready or updating:   # GKE sends no events: poll the node pool
            p.again(15, updating or step.message or "waiting for the GKE node pool")
        return NodePoolReport({"name": name, "state": step.state, "operation": pending, "nodeCount": node_count},
                              step.ready, step.message, updating)
    except GKEAuthError as e:
        p.issue("GKEAuthFailed", f"GKE API refused the operator's identity ({e.status}): {e.message}", retry=120)
        return unknown(str(e))
    except GKETransientError as e:
        # Not "not ready": not observed. The pass holds Ready and the last state GKE reported.
        p.again(30, str(e))
        p.failures.append(Cond("Degraded", True, GKE_API_ERROR,
                               f"node pool {name}: {e}; the status shows what was observed before"))
        return unknown(f"GKE API unavailable: {e}", recorded.get("state") or "Unknown")
    except GKEError as e:
        p.issue("GKEError", str(e), retry=60)
        return unknown(str(e))


async def _delete_node_pool(client: GKEClient, cluster: ClusterRef, name: str, mark: dict[str, str],
                            emit: Callable[[str, str, str], None]) -> tuple[bool, str | None]:
    """Asks GKE to delete one node pool: (True, None) once GKE reports it gone, or when it
    lacks the pool's mark (not the operator's to delete: left alone), else (False, the delete
    operation started now, if any). GKE errors propagate."""
    observed = await client.get_node_pool(cluster, name)
    if observed is None:
        emit("Normal", "NodePoolDeleted", f"GKE node pool {name} is gone")
        return True, None
    if not node_pool_marked(observed, mark):
        emit("Warning", NODE_POOL_NOT_OWNED, f"not deleting GKE node pool {name}: the operator did not create it "
                                             f"for this TPUSyncPool (it lacks the labels {mark_text(mark)})")
        return True, None
    if observed.get("status") != "STOPPING":
        op = await client.delete_node_pool(cluster, name)
        if op is None:
            return True, None
        emit("Normal", "NodePoolDeleting", f"deleting GKE node pool {name} (operation {op.get('name')})")
        return False, op.get("name")
    return False, None


async def delete_pool(body: dict[str, Any], deps: Deps) -> None:
    """Finalizer for mode gke: delete every slice's node pool and wait until GKE reports them gone."""
    spec = TPUSyncPoolSpec.model_validate(body.get("spec") or {})
    gke = spec.provisioning.gke
    if spec.provisioning.mode != "gke" or gke is None or deps.gke is None:
        return
    owner = Owner.from_body(body)
    cluster = ClusterRef(gke.project, gke.location, gke.cluster)
    try:
        wanted = [r.name for r in plan_pool(owner, spec).node_pool_requests]
    except PlanError:
        wanted = [names.gke_node_pool(owner.name, spec)]
    client = deps.gke
    mark = node_pool_mark(owner)
    waiting = []

    def emit(type_: str, reason: str, message: str) -> None:
        deps.emit(body, type_, reason, message)

    for name in sorted(set(wanted) | set(recorded_node_pools(body.get("status") or {}))):
        try:
            gone, _ = await _delete_node_pool(client, cluster, name, mark, emit)
            if not gone:
                waiting.append(name)
        except GKEConflict as e:
            raise kopf.TemporaryError(f"node pool {name} busy: {e.message}", delay=30) from e
        except GKEAuthError as e:
            raise kopf.TemporaryError(f"GKE API refused deleting node pool {name}: {e.message}", delay=120) from e
        except GKEError as e:
            raise kopf.TemporaryError(str(e), delay=30) from e
    if waiting:
        raise kopf.TemporaryError(f"waiting for GKE node pool {', '.join(waiting)} to be deleted", delay=15)
