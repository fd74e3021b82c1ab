"""The DisaggregatedServing pass: its pools, the optional CRDs served, children, and status."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import ValidationError

from . import versions
from .builders import names, sglang_pd
from .builders.common import LLMD_SERVING_LABEL, SERVING_LABEL, Owner
from .builders.llmd import lockstep
from .builders.serving import PoolInfo, role_selector, unit_pod_labels
from .kube import Kube, KubeError, selector_string
from .kv_path import CONDITION, EngineReading, KVPathObservation, kv_path_condition, parse_metrics, role_totals
from .models import DisaggregatedServingSpec, DisaggregatedServingStatus, KVCounters, KVPathStatus, TPUSyncPoolSpec
from .ownership import CONFLICT_RETRY_SECONDS, conflict_message
from .pool_plan import PlanError, check_pool
from .reconcile import Deps, Pass, apply_all, read_wanted
from .serving_plan import (
    OPTIONAL_KINDS,
    ServingPlan,
    capacity_shortfall,
    missing_crd_message,
    plan_serving,
    pool_refs,
    role_pools,
)
from .status import (
    NAME_CONFLICT,
    Cond,
    RevisionObservation,
    RoleObservation,
    ServingObservation,
    pod_ready,
    revisions_of,
    serving_conditions,
    workload_ready_replicas,
)


class _Blocked(Exception):
    """A pass that cannot go on until something outside the serving changes."""

    def __init__(self, reason: str, message: str, delay: float):
        super().__init__(message)
        self.reason, self.message, self.delay = reason, message, delay


async def reconcile_serving(body: dict[str, Any], deps: Deps) -> dict[str, Any]:
    """Reconcile one DisaggregatedServing; returns the status written. The pass: its pools, the
    optional CRDs served, the plan, the children applied, what they show, and the status."""
    p = Pass(body, DisaggregatedServingStatus)
    owner, kube = p.owner, deps.kube
    spec = await p.spec(deps, DisaggregatedServingSpec)

    async def finish_blocked(b: _Blocked, pool_ready: bool = False) -> dict[str, Any]:
        p.issue(b.reason, b.message, retry=b.delay, first=True)
        obs = ServingObservation(roles=[], routing_enabled=spec.routing.enabled, routing_ready=False,
                                 pool_ready=pool_ready, issues=p.issues)
        conds = p.conditions(deps, serving_conditions(obs))
        return await p.finish(deps, {"observedGeneration": p.generation, "conditions": conds, "routingReady": False})

    async def finish_held(e: KubeError) -> dict[str, Any]:
        return await p.finish_held(deps, e, ("observedGeneration", "prefill", "decode", "endpoint", "routingReady",
                                             "replicas", "selector", "rollout", "kvPath"))

    try:
        pools, pool_ready = await _read_pools(kube, owner, spec)
        available = await kube.served_kinds(OPTIONAL_KINDS)
    except _Blocked as b:
        return await finish_blocked(b)
    except KubeError as e:
        return await finish_held(e)
    try:
        plan = plan_serving(owner, spec, pools[spec.pool_ref.name], available, role_pools(spec, pools))
    except PlanError as e:
        await p.invalid(deps, str(e))
    shortfall = capacity_shortfall(plan.roles)
    if shortfall:
        p.issue("InsufficientCapacity", shortfall)
    try:
        # sglang-jax's P/D shared secret is created once, like a pool's auth Secret.
        once = [sglang_pd.build_secret(owner, deps.token().hex())] if spec.engine.type == "sglang-jax" else []
        written = await apply_all(kube, owner, await read_wanted(kube, owner, plan.apply, once), plan.delete)
    except KubeError as e:
        return await finish_held(e)
    if names.pd_secret(owner.name) in written.created:
        p.event("Normal", "SecretGenerated", f"generated sglang-jax P/D secret {names.pd_secret(owner.name)}")
    if written.conflicts:       # its workloads may be another's: nothing of them is observed
        return await finish_blocked(_Blocked(NAME_CONFLICT, conflict_message(owner, written.conflicts),
                                             CONFLICT_RETRY_SECONDS), pool_ready)
    try:
        roles, revisions = await _observe_roles(kube, owner, spec, plan)
        epp_ready = spec.routing.enabled and await _available(kube, owner.namespace, names.epp(owner.name))
        bootstrap_ready = (spec.engine.type != "sglang-jax"
                           or await _available(kube, owner.namespace, names.pd_bootstrap(owner.name)))
        readings = await _read_engines(kube, deps, owner, spec, roles)
    except KubeError as e:
        return await finish_held(e)
    if plan.missing_kinds:
        p.again(60, missing_crd_message(plan.missing_kinds))
    routing_ready = spec.routing.enabled and epp_ready and "InferencePool" not in plan.missing_kinds
    obs = ServingObservation(roles=roles, routing_enabled=spec.routing.enabled, routing_ready=routing_ready,
                             pool_ready=pool_ready,
                             missing_kinds_message=(missing_crd_message(plan.missing_kinds)
                                                    if plan.missing_kinds else ""),
                             issues=p.issues, pd_bootstrap_ready=bootstrap_ready, revisions=revisions)
    kv = KVPathObservation(disaggregated=len(roles) == 2 and all(r.replicas > 0 for r in roles),
                           observable=spec.engine.type != "sglang-jax", readings=readings,
                           previous=_kv_totals(p.old), previous_condition=_condition(p.old, CONDITION))
    conds = p.conditions(deps, [*serving_conditions(obs), kv_path_condition(kv)])
    return await p.finish(deps, {"observedGeneration": p.generation, "conditions": conds,
                                 **_observed_status(owner, spec, roles, revisions, readings, routing_ready)})


async def _read_pools(kube: Kube, owner: Owner, spec: DisaggregatedServingSpec) -> tuple[dict[str, PoolInfo], bool]:
    """The TPUSyncPools the serving names, checked, and whether every one is Ready; _Blocked
    when one is missing or invalid."""
    pools: dict[str, PoolInfo] = {}
    pool_ready = True
    for name, field in pool_refs(spec).items():
        pool_body = await kube.get("tpusync.dev/v1alpha1", "TPUSyncPool", owner.namespace, name)
        if pool_body is None:
            raise _Blocked("PoolNotFound", f"{field}: TPUSyncPool {name} not found in namespace {owner.namespace}", 30)
        try:
            pool_spec = TPUSyncPoolSpec.model_validate(pool_body.get("spec") or {})
            pools[name] = PoolInfo(name, pool_spec, check_pool(pool_spec))
        except (ValidationError, PlanError) as e:
            raise _Blocked("PoolInvalid", f"{field}: TPUSyncPool {name} is invalid: {e}", 60) from e
        pool_ready = pool_ready and any(c.get("type") == "Ready" and c.get("status") == "True"
                                        for c in (pool_body.get("status") or {}).get("conditions", []))
    return pools, pool_ready


async def _observe_roles(kube: Kube, owner: Owner, spec: DisaggregatedServingSpec,
                         plan: ServingPlan) -> tuple[list[RoleObservation], list[RevisionObservation]]:
    """Each role's workload as the API server shows it; with lockstep rollouts, the revisions of
    the DisaggregatedSet too, and the roles' readiness is the newest one's (where a rollout heads)."""
    if lockstep(spec):
        revisions: list[RevisionObservation] = []
        if "DisaggregatedSet" not in plan.missing_kinds:
            revisions = revisions_of(
                await kube.list(OPTIONAL_KINDS["LeaderWorkerSet"][0], "LeaderWorkerSet", owner.namespace,
                                {versions.DS_NAME_LABEL: names.disaggregated_set(owner.name),
                                 SERVING_LABEL: owner.name}),
                versions.DS_REVISION_LABEL, versions.DS_ROLE_LABEL)
        newest = revisions[0].ready if revisions else {}
        return [RoleObservation(rp.role, rp.kind, rp.replicas, newest.get(rp.role, 0)) for rp in plan.roles], revisions
    roles = []
    for rp in plan.roles:
        obj = None
        if rp.kind not in plan.missing_kinds:
            api = "apps/v1" if rp.kind == "Deployment" else OPTIONAL_KINDS["LeaderWorkerSet"][0]
            obj = await kube.get(api, rp.kind, owner.namespace, names.role(owner.name, rp.role))
        roles.append(RoleObservation(rp.role, rp.kind, rp.replicas, workload_ready_replicas(obj)))
    return roles, []


def _observed_status(owner: Owner, spec: DisaggregatedServingSpec, roles: list[RoleObservation],
                     revisions: list[RevisionObservation], readings: list[EngineReading],
                     routing_ready: bool) -> dict[str, Any]:
    """The status fields besides the conditions: the roles, where clients reach the serving,
    the scale subresource's replicas and selector, the rollout, and the KV path's counters."""
    kv_totals = role_totals(readings)
    role_status = {r.role: {"kind": r.kind, "replicas": r.replicas, "readyReplicas": r.ready_replicas} for r in roles}
    return {
        "prefill": role_status.get("prefill"), "decode": role_status.get("decode"),
        "endpoint": _endpoint(owner, spec), "routingReady": routing_ready,
        "replicas": spec.replicas, "selector": selector_string(unit_pod_labels(owner, spec)),
        "rollout": _rollout(spec, revisions),
        "kvPath": KVPathStatus(
            prefill=KVCounters(**kv_totals["prefill"]) if "prefill" in kv_totals else None,
            decode=KVCounters(**kv_totals["decode"]) if "decode" in kv_totals else None,
            engines_read=sum(1 for r in readings if not r.error), engines_unread=sum(1 for r in readings if r.error),
        ).dump(),
    }


async def _read_engines(kube: Kube, deps: Deps, owner: Owner, spec: DisaggregatedServingSpec,
                        roles: list[RoleObservation]) -> list[EngineReading]:
    """Every ready serving pod's KV-path counters, read from its engine's /metrics at once (the
    port clients reach: the serving's NetworkPolicy admits it). A pod that cannot be read is a
    reading with its error; a KubeError of the pod list stops the pass."""
    if spec.engine.type == "sglang-jax":
        return []
    pods = []
    for r in roles:
        for pod in await kube.list("v1", "Pod", owner.namespace,
                                   {**role_selector(owner, r.role), LLMD_SERVING_LABEL: "true"}):
            ip = (pod.get("status") or {}).get("podIP")
            if ip and pod_ready(pod) and not pod["metadata"].get("deletionTimestamp"):
                pods.append((r.role, pod["metadata"]["name"], ip))

    async def read(role: str, name: str, ip: str) -> EngineReading:
        host = f"[{ip}]" if ":" in ip else ip
        try:
            parsed = parse_metrics(await deps.read_text(f"http://{host}:{spec.port}/metrics"))
        except (OSError, ValueError) as e:
            return EngineReading(name, role, error=str(e) or type(e).__name__)
        return EngineReading(name, role) if parsed is None else EngineReading(name, role, *parsed)
    return list(await asyncio.gather(*(read(*p) for p in pods)))


def _kv_totals(status: dict[str, Any]) -> dict[str, dict[str, int]] | None:
    kv = status.get("kvPath") or {}
    try:
        parsed = KVPathStatus.model_validate(kv)
    except ValidationError:
        return None
    return {role: counters.model_dump() for role, counters in (("prefill", parsed.prefill),
                                                               ("decode", parsed.decode)) if counters is not None}


def _condition(status: dict[str, Any], type_: str) -> Cond | None:
    for c in status.get("conditions") or []:
        if c.get("type") == type_:
            value = c.get("status")
            return Cond(type_, None if value == "Unknown" else value == "True", c.get("reason", ""),
                        c.get("message", ""))
    return None


async def _available(kube: Kube, namespace: str, deployment: str) -> bool:
    obj = await kube.get("apps/v1", "Deployment", namespace, deployment)
    return int(((obj or {}).get("status") or {}).get("availableReplicas", 0) or 0) > 0


def _rollout(spec: DisaggregatedServingSpec, revisions: list[RevisionObservation]) -> dict[str, Any]:
    if not lockstep(spec):
        return {"strategy": spec.rollout.strategy}

    def role(r: RevisionObservation, name: str) -> dict[str, int]:
        return {"replicas": r.replicas.get(name, 0), "readyReplicas": r.ready.get(name, 0)}
    return {"strategy": spec.rollout.strategy, "revision": revisions[0].revision if revisions else None,
            "revisions": [{"revision": r.revision, "prefill": role(r, "prefill"), "decode": role(r, "decode")}
                          for r in revisions]}


def _endpoint(owner: Owner, spec: DisaggregatedServingSpec) -> str:
    gw = spec.routing.gateway_ref
    if gw is not None and spec.routing.enabled:
        return f"gateway/{gw.namespace or owner.namespace}/{gw.name}"
    role = "decode" if spec.decode.replicas > 0 else "prefill"
    return f"http://{names.role(owner.name, role)}.{owner.namespace}.svc:{spec.port}"
