"""The TPUSyncPool pass: its GKE node pools (mode gke), auth Secret, children, and status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .builders import names
from .builders.common import COMPONENT_LABEL, POOL_LABEL, Owner
from .builders.pool import build_auth_secret
from .kube import Kube, KubeError
from .models import TPUSyncPoolSpec, TPUSyncPoolStatus
from .nodepools import reconcile_node_pools
from .ownership import CONFLICT_RETRY_SECONDS, Conflict, conflict_message
from .pool_plan import SHARED_CAPACITY_BEYOND_CLAIM, Child, PlanError, PoolPlan, plan_pool, shared_claim_problem
from .reconcile import Deps, Pass, Written, apply_all, read_wanted
from .status import (
    NAME_CONFLICT,
    Capacity,
    PoolObservation,
    held_conditions,
    node_ready,
    pool_capacity,
    pool_conditions,
    sidecar_ready,
)


async def reconcile_pool(body: dict[str, Any], deps: Deps) -> dict[str, Any]:
    """Reconcile one TPUSyncPool; returns the status written."""
    p = Pass(body, TPUSyncPoolStatus)
    owner, old, kube = p.owner, p.old, deps.kube
    spec = await p.spec(deps, TPUSyncPoolSpec)
    try:
        plan = plan_pool(owner, spec)
    except PlanError as e:
        await p.invalid(deps, str(e))
    node_pools = _NodePools.initial(spec)
    try:
        secret_name, once = await _read_inputs(deps, p, owner, spec)
        read = await read_wanted(kube, owner, plan.apply, once)
        if spec.provisioning.mode == "gke":
            node_pools = await _gke_node_pools(deps, p, owner, spec, plan, read.conflicts)
        written = await apply_all(kube, owner, read, plan.delete)
        _report_written(p, owner, written, secret_name)
        nodes = await kube.list("v1", "Node", None, plan.node_selector) if plan.node_selector else []
        pods = await kube.list("v1", "Pod", owner.namespace, {POOL_LABEL: owner.name})
        if written.conflicts:     # the store's workload may be another's: not observed
            store_ready, store_desired = 0, -1 if plan.store_replicas is None else plan.store_replicas
        else:
            store_ready, store_desired = await _store_nodes(kube, owner, spec, plan.store_replicas)
    except KubeError as e:
        # Node pool entries are written even so: they record GKE operations started this pass.
        return await p.finish_held(deps, e, ("observedGeneration", "hosts", "readyHosts", "sidecars", "readySidecars",
                                             "dramBytes", "diskBytes", "peersService"),
                                   nodePool=node_pools.entry, nodePools=node_pools.entries)
    ready_hosts = sum(1 for n in nodes if node_ready(n))
    cap: Capacity = pool_capacity(pods)
    # The workload's count and the pods were read at different moments: a store pod counts as
    # ready only when the pod list the message counts from shows its sidecar ready too.
    store_ready = min(store_ready, sum(1 for p in pods if sidecar_ready(p) and
                                       p.get("metadata", {}).get("labels", {}).get(COMPONENT_LABEL) == "store"))
    obs = PoolObservation(mode=spec.provisioning.mode, desired_hosts=plan.desired_hosts,
                          min_ready_hosts=plan.min_ready_hosts, ready_hosts=ready_hosts, capacity=cap,
                          store_desired=store_desired, store_ready=store_ready,
                          node_pool_state=node_pools.entry["state"], node_pool_ready=node_pools.ready,
                          node_pool_message=node_pools.message, node_pool_updating=node_pools.updating,
                          issues=p.issues)
    if p.failures:      # GKE did not answer: whether its node pools are ready is not known
        conds = held_conditions(old.get("conditions"), p.failures + p.issues, p.generation, deps.now())
    else:
        conds = p.conditions(deps, pool_conditions(obs))
    return await p.finish(deps, {
        "observedGeneration": old.get("observedGeneration") if p.failures else p.generation, "conditions": conds,
        "nodePool": node_pools.entry, "nodePools": node_pools.entries,
        "hosts": plan.desired_hosts, "readyHosts": ready_hosts, "sidecars": cap.sidecars,
        "readySidecars": cap.ready_sidecars, "dramBytes": cap.dram_bytes, "diskBytes": cap.disk_bytes,
        "peersService": names.peers_dns(owner.name, owner.namespace),
    })


@dataclass
class _NodePools:
    """What the status says of the pool's node pools."""

    entry: dict[str, Any]                        # status.nodePool
    entries: list[dict[str, Any]] | None = None  # status.nodePools (mode gke)
    ready: bool = True
    message: str = ""
    updating: str = ""

    @staticmethod
    def initial(spec: TPUSyncPoolSpec) -> _NodePools:
        """Before any GKE call: mode existing's named node pool (none for mode gke yet)."""
        existing = spec.provisioning.existing if spec.provisioning.mode != "gke" else None
        return _NodePools({"name": existing.node_pool_name if existing else None, "state": "Existing",
                           "operation": None})


async def _read_inputs(deps: Deps, p: Pass, owner: Owner, spec: TPUSyncPoolSpec) -> tuple[str, list[Child]]:
    """The auth Secret's name and the children created once (a generated Secret); the user's
    Secret and shared-tier claim read, their problems raised as issues."""
    secret_name = names.pool_auth(owner.name, spec)
    once = []
    if spec.auth.secret_name:    # the user's Secret: only read, never written
        if await deps.kube.get("v1", "Secret", owner.namespace, secret_name) is None:
            p.issue("AuthSecretMissing", f"spec.auth.secretName: Secret {secret_name} not found", retry=30)
    else:   # generated: created once, never re-applied (that would rotate the token under running pods)
        once = [build_auth_secret(owner, spec, deps.token())]
    shared = spec.tiers.shared
    if shared is not None and shared.claim_name and shared.capacity:   # the user's claim: only read
        claim = await deps.kube.get("v1", "PersistentVolumeClaim", owner.namespace, shared.claim_name)
        if problem := shared_claim_problem(spec, claim):
            p.issue(SHARED_CAPACITY_BEYOND_CLAIM, problem, retry=60)   # a resized claim sends no event here
    return secret_name, once


async def _gke_node_pools(deps: Deps, p: Pass, owner: Owner, spec: TPUSyncPoolSpec, plan: PoolPlan,
                          conflicts: list[Conflict]) -> _NodePools:
    """Mode gke: the node pools reconciled through GKE's API, unless a child's name is held."""
    if conflicts:  # nothing is written, GKE's node pools included: as last reported
        return _NodePools(p.old.get("nodePool") or {"name": None, "state": None, "operation": None},
                          p.old.get("nodePools"), False, "not reconciled while a name is held (NameConflict)")
    report = await reconcile_node_pools(deps, p, owner, spec, plan, p.old)
    return _NodePools(report.entries[0], report.entries, report.ready, report.message, report.updating)


def _report_written(p: Pass, owner: Owner, written: Written, secret_name: str) -> None:
    """The pass's events and issues of what apply_all wrote: a generated Secret, names held by others."""
    if secret_name in written.created:
        p.event("Normal", "SecretGenerated", f"generated auth Secret {secret_name}")
    if written.conflicts:
        message = conflict_message(owner, written.conflicts)
        if any(c.kind == "Secret" and c.name == secret_name for c in written.conflicts):
            message += f"; if Secret {secret_name} is meant as this pool's auth Secret, set spec.auth.secretName"
        p.issue(NAME_CONFLICT, message, retry=CONFLICT_RETRY_SECONDS, first=True)


async def _store_nodes(kube: Kube, owner: Owner, spec: TPUSyncPoolSpec, desired: int | None) -> tuple[int, int]:
    """(ready, desired) store pods; desired -1 for a DaemonSet not scheduled yet."""
    if not spec.store_nodes.enabled:
        return 0, 0
    obj = await kube.get("apps/v1", spec.store_nodes.kind, owner.namespace, names.pool_store(owner.name))
    st = (obj or {}).get("status", {})
    if spec.store_nodes.kind == "DaemonSet":
        return int(st.get("numberReady", 0) or 0), int(st.get("desiredNumberScheduled", 0) or 0) or -1
    assert desired is not None   # a StatefulSet's replicas, from the plan
    return int(st.get("readyReplicas", 0) or 0), desired
