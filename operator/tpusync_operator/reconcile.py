"""The one level-based reconcile per kind. Every pass (create, update, resume, timer) does:
parse -> plan -> act on the cloud (GKE) -> server-side apply children, delete stale ones ->
observe -> write status once -> emit events -> raise TemporaryError if it should come back
sooner than the timer. It is idempotent: running it twice changes nothing the second time.

A request to the Kubernetes API that fails (a 5xx, a timeout, a refusal) stops the pass where
it is: what it did not observe is not "nothing there". Its status then keeps every value
observed before, Ready and Progressing as they were, and Degraded names the failed request
(`held_conditions`); the pass comes back soon."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

import kopf
from pydantic import ValidationError

from .builders import names, sglang_pd
from .builders.common import POOL_LABEL, Owner
from .builders.pool import build_auth_secret
from .builders.serving import PoolInfo
from .gke import ClusterRef, GKEAuthError, GKEClient, GKEConflict, GKEError, GKETransientError
from .kube import Kube, KubeError
from .models import DisaggregatedServingSpec, DisaggregatedServingStatus, TPUSyncPoolSpec, TPUSyncPoolStatus
from .planner import (OPTIONAL_KINDS, PlanError, capacity_shortfall, check_pool, missing_crd_message,
                      node_pool_step, plan_pool, plan_serving)
from .status import (API_ERROR, GKE_API_ERROR, REJECTED, Capacity, Clock, Cond, PoolObservation, RoleObservation,
                     ServingObservation, held_conditions, merge_conditions, pool_capacity, pool_conditions,
                     serving_conditions, transitions, workload_ready_replicas, node_ready, utc_now)

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any], str, str, str], None]   # (body, type, reason, message)


def _kopf_emit(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message)


@dataclass
class Deps:
    """Everything a reconcile talks to, injected (tests pass fakes)."""
    kube: Kube
    gke: Callable[[str], GKEClient] | None = None     # api endpoint -> client
    now: Clock = utc_now
    token: Callable[[], bytes] = lambda: secrets.token_bytes(32)
    emit: Emit = _kopf_emit


@dataclass
class _Pass:
    """Per-pass accumulator: events are held until the status write has succeeded."""
    body: dict[str, Any]
    events: list[tuple[str, str, str]] = field(default_factory=list)
    issues: list[Cond] = field(default_factory=list)
    failures: list[Cond] = field(default_factory=list)   # requests that failed: what it could not observe
    retry: tuple[float, str] | None = None

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def issue(self, reason: str, message: str, retry: float | None = None) -> None:
        self.issues.append(Cond("Degraded", True, reason, message))
        if retry is not None:
            self.again(retry, message)

    def again(self, delay: float, message: str) -> None:
        if self.retry is None or delay < self.retry[0]:
            self.retry = (delay, message)


def _full_status(model: type, values: dict[str, Any]) -> dict[str, Any]:
    """Every status field, None included, so a merge patch also clears stale fields."""
    out = {f.alias or k: None for k, f in model.model_fields.items()}
    out.update(values)
    return out


async def _finish(deps: Deps, p: _Pass, api_version: str, kind: str, status_model: type,
                  values: dict[str, Any]) -> dict[str, Any]:
    meta = p.body["metadata"]
    old = (p.body.get("status") or {}).get("conditions")
    status = _full_status(status_model, values)
    await deps.kube.patch_status(api_version, kind, meta["namespace"], meta["name"], status)
    was_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in old or [])
    for c in transitions(old, status["conditions"]):
        if c["type"] == "Ready" and c["status"] == "True":
            p.event("Normal", "Ready", c["message"])
        elif c["type"] == "Ready" and was_ready:
            p.event("Warning", "NotReady", f"{c['reason']}: {c['message']}")
        elif c["type"] == "Degraded" and c["status"] == "True":
            p.event("Warning", c["reason"], c["message"])
    for type_, reason, message in p.events:
        deps.emit(p.body, type_, reason, message)
    if p.retry is not None:
        raise kopf.TemporaryError(p.retry[1], delay=p.retry[0])
    return status


async def _invalid(deps: Deps, p: _Pass, api_version: str, kind: str, status_model: type, message: str) -> None:
    now = deps.now()
    meta = p.body["metadata"]
    old = (p.body.get("status") or {}).get("conditions")
    conds = merge_conditions(old, [Cond("Ready", False, "InvalidSpec", message),
                                   Cond("Progressing", False, "InvalidSpec", message),
                                   Cond("Degraded", True, "InvalidSpec", message)], meta.get("generation"), now)
    await _finish(deps, p, api_version, kind, status_model,
                  {**{k: v for k, v in (p.body.get("status") or {}).items()},
                   "observedGeneration": meta.get("generation"), "conditions": conds})
    raise kopf.PermanentError(message)


def _validation_message(e: ValidationError, root: str = "spec") -> str:
    first = e.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    return f"{root}.{loc}: {first['msg']}"


async def _apply_all(kube: Kube, namespace: str, apply: list[dict[str, Any]], delete: list[Any]) -> None:
    for obj in apply:
        await kube.apply(obj)
    for ref in delete:
        await kube.delete(ref.api_version, ref.kind, namespace, ref.name)


def _request_failed(p: _Pass, e: KubeError) -> None:
    """Records the request that stopped the pass; it comes back sooner after a transient
    failure than after a refusal (which needs a fix: RBAC, a webhook...)."""
    if e.status in (400, 403, 422):
        p.again(60, str(e))
        p.failures.append(Cond("Degraded", True, REJECTED, str(e)))
    else:
        p.again(10, str(e))
        p.failures.append(Cond("Degraded", True, API_ERROR, f"{e}; the status shows what was observed before"))


def _kept(old: dict[str, Any], *names: str) -> dict[str, Any]:
    """The named status fields as last written (None where never written)."""
    return {n: old.get(n) for n in names}


# ------------------------------------------------------------------ pool

async def reconcile_pool(body: dict[str, Any], deps: Deps) -> dict[str, Any]:
    """Reconcile one TPUSyncPool; returns the status written."""
    p = _Pass(body)
    owner = Owner.from_body(body)
    gen = body["metadata"].get("generation")
    old = body.get("status") or {}
    try:
        spec = TPUSyncPoolSpec.model_validate(body.get("spec") or {})
        plan = plan_pool(owner, spec)
    except ValidationError as e:
        await _invalid(deps, p, owner.api_version, owner.kind, TPUSyncPoolStatus, _validation_message(e))
        raise AssertionError("unreachable")
    except PlanError as e:
        await _invalid(deps, p, owner.api_version, owner.kind, TPUSyncPoolStatus, str(e))
        raise AssertionError("unreachable")
    kube = deps.kube

    node_pool: dict[str, Any] = {"name": None, "state": "Existing", "operation": None}
    node_pools: list[dict[str, Any]] | None = None
    node_pool_ready, node_pool_message, node_pool_updating = True, "", ""
    if spec.provisioning.mode == "gke":
        node_pools, node_pool_ready, node_pool_message, node_pool_updating = await _gke_node_pools(
            deps, p, owner, spec, plan, old)
        node_pool = node_pools[0]
    else:
        existing = spec.provisioning.existing
        node_pool["name"] = existing.node_pool_name if existing else None

    try:
        secret_name = names.pool_auth(owner.name, spec)
        if spec.auth.secret_name:
            if await kube.get("v1", "Secret", owner.namespace, secret_name) is None:
                p.issue("AuthSecretMissing", f"spec.auth.secretName: Secret {secret_name} not found", retry=30)
        elif await kube.get("v1", "Secret", owner.namespace, secret_name) is None:
            # Created once, never re-applied: re-applying would rotate the token under running pods.
            if await kube.create(build_auth_secret(owner, spec, deps.token())):
                p.event("Normal", "SecretGenerated", f"generated auth Secret {secret_name}")
        await _apply_all(kube, owner.namespace, plan.apply, plan.delete)
        nodes = await kube.list("v1", "Node", None, plan.node_selector) if plan.node_selector else []
        pods = await kube.list("v1", "Pod", owner.namespace, {POOL_LABEL: owner.name})
        store_ready, store_desired = await _store_nodes(kube, owner, spec, plan.store_replicas)
    except KubeError as e:
        _request_failed(p, e)
        # Node pool entries are written even so: they record GKE operations started this pass.
        return await _finish(deps, p, owner.api_version, owner.kind, TPUSyncPoolStatus, {
            **_kept(old, "observedGeneration", "hosts", "readyHosts", "sidecars", "readySidecars", "dramBytes",
                    "diskBytes", "peersService"),
            "conditions": held_conditions(old.get("conditions"), p.failures + p.issues, gen, deps.now()),
            "nodePool": node_pool, "nodePools": node_pools,
        })
    ready_hosts = sum(1 for n in nodes if node_ready(n))
    cap: Capacity = pool_capacity(pods)
    obs = PoolObservation(mode=spec.provisioning.mode, desired_hosts=plan.desired_hosts,
                          min_ready_hosts=plan.min_ready_hosts, ready_hosts=ready_hosts, capacity=cap,
                          store_desired=store_desired, store_ready=store_ready,
                          node_pool_state=node_pool["state"], node_pool_ready=node_pool_ready,
                          node_pool_message=node_pool_message, node_pool_updating=node_pool_updating,
                          issues=p.issues)
    if p.failures:      # GKE did not answer: whether its node pools are ready is not known
        conds = held_conditions(old.get("conditions"), p.failures + p.issues, gen, deps.now())
    else:
        conds = merge_conditions(old.get("conditions"), pool_conditions(obs), gen, deps.now())
    return await _finish(deps, p, owner.api_version, owner.kind, TPUSyncPoolStatus, {
        "observedGeneration": old.get("observedGeneration") if p.failures else gen, "conditions": conds,
        "nodePool": node_pool, "nodePools": node_pools,
        "hosts": plan.desired_hosts, "readyHosts": ready_hosts, "sidecars": cap.sidecars,
        "readySidecars": cap.ready_sidecars, "dramBytes": cap.dram_bytes, "diskBytes": cap.disk_bytes,
        "peersService": names.peers_dns(owner.name, owner.namespace),
    })


async def _store_nodes(kube: Kube, owner: Owner, spec: TPUSyncPoolSpec, desired: int) -> tuple[int, int]:
    if not spec.store_nodes.enabled:
        return 0, 0
    obj = await kube.get("apps/v1", spec.store_nodes.kind, owner.namespace, names.pool_store(owner.name))
    st = (obj or {}).get("status", {})
    if spec.store_nodes.kind == "DaemonSet":
        return int(st.get("numberReady", 0) or 0), int(st.get("desiredNumberScheduled", 0) or 0) or -1
    return int(st.get("readyReplicas", 0) or 0), desired


def _recorded_node_pools(old: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """status.nodePools by name (status.nodePool alone in a status from an older operator)."""
    entries = old.get("nodePools") or ([old["nodePool"]] if old.get("nodePool") else [])
    return {e["name"]: e for e in entries if e.get("name")}


async def _gke_node_pools(deps: Deps, p: _Pass, owner: Owner, spec: TPUSyncPoolSpec, plan: Any,
                          old: dict[str, Any]) -> tuple[list[dict[str, Any]], bool, str, str]:
    """The GKE step for every slice's node pool, then the deletion of node pools of slices
    the spec no longer has. Returns (status.nodePools, all ready, message, updating)."""
    gke = spec.provisioning.gke
    assert gke is not None and deps.gke is not None and plan.node_pool_requests
    cluster = ClusterRef(gke.project, gke.location, gke.cluster)
    client = deps.gke(gke.api_endpoint)
    recorded = _recorded_node_pools(old)
    entries, ready, message, updating = [], True, "", ""
    for request in plan.node_pool_requests:
        name = request["nodePool"]["name"]
        # GKE runs one operation per cluster: start none while another is in flight.
        idle = not any(e.get("operation") for e in entries) and \
            not any(e.get("operation") for n, e in recorded.items() if n != name)
        entry, ok, msg, upd = await _gke_node_pool(p, client, cluster, name, request, recorded.get(name, {}),
                                                   plan.tpu.multi_host, may_start=idle)
        entries.append(entry)
        ready, message, updating = ready and ok, message or ("" if ok else msg), updating or upd
    for name in sorted(set(recorded) - {e["name"] for e in entries}):   # slices the spec dropped
        gone, op_name = False, recorded[name].get("operation")
        try:
            op = await client.get_operation(cluster, op_name) if op_name else None
            busy = any(e.get("operation") for e in entries)
            if (op is None and not busy) or (op is not None and op.get("status") == "DONE"):
                if (op or {}).get("error"):
                    p.issue("NodePoolOperationFailed", f"deleting node pool {name}: {op['error']}; retrying")
                gone, op_name = await _delete_node_pool(client, cluster, name, p.event)
        except GKEConflict as e:
            p.again(15, f"node pool {name}: {e.message}")
        except GKEError as e:
            p.issue("GKEError", f"deleting node pool {name}: {e}", retry=60)
        if not gone:
            entries.append({"name": name, "state": "STOPPING", "operation": op_name, "nodeCount": None})
            p.again(15, f"waiting for GKE node pool {name} to be deleted")
    return entries, ready, message, updating


async def _gke_node_pool(p: _Pass, client: GKEClient, cluster: ClusterRef, name: str, request: dict[str, Any],
                         recorded: dict[str, Any], multi_host: bool,
                         may_start: bool = True) -> tuple[dict[str, Any], bool, str, str]:
    """One node pool: at most one call that changes it (create, setSize or setAutoscaling)
    per pass, none while the operation recorded in status runs (or, without `may_start`,
    one on another node pool). Returns (its status entry, ready, message, updating: what is
    in flight on a serving node pool)."""
    op_name, node_count = recorded.get("operation"), recorded.get("nodeCount")

    def unknown(message: str, state: str = "Unknown") -> tuple[dict[str, Any], bool, str, str]:
        return {"name": name, "state": state, "operation": op_name, "nodeCount": node_count}, False, message, ""

    try:
        op = await client.get_operation(cluster, op_name) if op_name else None
        observed = await client.get_node_pool(cluster, name)
        step = node_pool_step(request, op, observed, node_count=node_count, multi_host=multi_host)
        pending = op_name if op is not None and op.get("status") != "DONE" else None
        updating = step.message if step.updating else ""
        try:
            if step.action in ("create", "set_size", "set_autoscaling") and not may_start:
                p.again(15, f"node pool {name}: waiting for another node pool's operation")
                node_count = recorded.get("nodeCount")
                return ({"name": name, "state": step.state, "operation": None, "nodeCount": node_count},
                        step.ready, step.message, updating)
            if step.action == "create":
                started = await client.create_node_pool(cluster, request)
                p.event("Normal", "NodePoolCreating", f"creating GKE node pool {name} (operation {started.get('name')})")
            elif step.action == "set_size":
                started = await client.set_node_pool_size(cluster, name, step.body["nodeCount"])
                p.event("Normal", "NodePoolResizing", f"{step.message} (operation {started.get('name')})")
            elif step.action == "set_autoscaling":
                started = await client.set_node_pool_autoscaling(cluster, name, step.body["autoscaling"])
                p.event("Normal", "NodePoolAutoscalingChanged", f"{step.message} (operation {started.get('name')})")
            else:
                started = None
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
        return ({"name": name, "state": step.state, "operation": pending, "nodeCount": node_count},
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


async def _delete_node_pool(client: GKEClient, cluster: ClusterRef, name: str,
                            emit: Callable[[str, str, str], None]) -> tuple[bool, str | None]:
    """Asks GKE to delete one node pool: (True, None) once GKE reports it gone, else (False,
    the delete operation started now, if any). GKE errors propagate."""
    observed = await client.get_node_pool(cluster, name)
    if observed is None:
        emit("Normal", "NodePoolDeleted", f"GKE node pool {name} is gone")
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
        wanted = [r["nodePool"]["name"] for r in plan_pool(owner, spec).node_pool_requests]
    except PlanError:
        wanted = [names.gke_node_pool(owner.name, spec)]
    client = deps.gke(gke.api_endpoint)
    waiting = []
    for name in sorted(set(wanted) | set(_recorded_node_pools(body.get("status") or {}))):
        try:
            gone, _ = await _delete_node_pool(client, cluster, name, lambda *a: deps.emit(body, *a))
            if not gone:
                waiting.append(name)
        except GKEConflict as e:
            raise kopf.TemporaryError(f"node pool {name} busy: {e.message}", delay=30)
        except GKEAuthError as e:
            raise kopf.TemporaryError(f"GKE API refused deleting node pool {name}: {e.message}", delay=120)
        except GKEError as e:
            raise kopf.TemporaryError(str(e), delay=30)
    if waiting:
        raise kopf.TemporaryError(f"waiting for GKE node pool {', '.join(waiting)} to be deleted", delay=15)


# ---------------------------------------------------------------- serving

async def reconcile_serving(body: dict[str, Any], deps: Deps) -> dict[str, Any]:
    """Reconcile one DisaggregatedServing; returns the status written."""
    p = _Pass(body)
    owner = Owner.from_body(body)
    gen = body["metadata"].get("generation")
    old = body.get("status") or {}
    kube = deps.kube
    try:
        spec = DisaggregatedServingSpec.model_validate(body.get("spec") or {})
    except ValidationError as e:
        await _invalid(deps, p, owner.api_version, owner.kind, DisaggregatedServingStatus, _validation_message(e))
        raise AssertionError("unreachable")

    def finish_blocked(reason: str, message: str, delay: float) -> Any:
        p.issue(reason, message, retry=delay)
        obs = ServingObservation(roles=[], routing_enabled=spec.routing.enabled, routing_ready=False,
                                 pool_ready=False, issues=p.issues)
        conds = merge_conditions(old.get("conditions"), serving_conditions(obs), gen, deps.now())
        return _finish(deps, p, owner.api_version, owner.kind, DisaggregatedServingStatus,
                       {"observedGeneration": gen, "conditions": conds, "routingReady": False})

    def finish_held(e: KubeError) -> Any:
        _request_failed(p, e)
        conds = held_conditions(old.get("conditions"), p.failures + p.issues, gen, deps.now())
        return _finish(deps, p, owner.api_version, owner.kind, DisaggregatedServingStatus, {
            **_kept(old, "observedGeneration", "prefill", "decode", "endpoint", "routingReady"),
            "conditions": conds})

    try:
        pool_body = await kube.get("tpusync.dev/v1alpha1", "TPUSyncPool", owner.namespace, spec.pool_ref.name)
    except KubeError as e:
        return await finish_held(e)
    if pool_body is None:
        return await finish_blocked("PoolNotFound", f"spec.poolRef.name: TPUSyncPool {spec.pool_ref.name} "
                                    f"not found in namespace {owner.namespace}", 30)
    try:
        pool_spec = TPUSyncPoolSpec.model_validate(pool_body.get("spec") or {})
        pool = PoolInfo(spec.pool_ref.name, pool_spec, check_pool(pool_spec))
    except (ValidationError, PlanError) as e:
        return await finish_blocked("PoolInvalid", f"spec.poolRef.name: TPUSyncPool {spec.pool_ref.name} "
                                    f"is invalid: {e}", 60)
    pool_ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                     for c in (pool_body.get("status") or {}).get("conditions", []))

    try:
        available = await kube.served_kinds(OPTIONAL_KINDS)
    except KubeError as e:
        return await finish_held(e)
    try:
        plan = plan_serving(owner, spec, pool, available)
    except PlanError as e:
        await _invalid(deps, p, owner.api_version, owner.kind, DisaggregatedServingStatus, str(e))
        raise AssertionError("unreachable")
    shortfall = capacity_shortfall(plan.roles, pool)
    if shortfall:
        p.issue("InsufficientCapacity", shortfall)
    roles: list[RoleObservation] = []
    epp_ready = False
    bootstrap_ready = spec.engine.type != "sglang-jax"
    try:
        if spec.engine.type == "sglang-jax":
            await _pd_secret(kube, p, owner, deps)
        await _apply_all(kube, owner.namespace, plan.apply, plan.delete)
        for rp in plan.roles:
            obj = None
            if rp.kind not in plan.missing_kinds:
                api = "apps/v1" if rp.kind == "Deployment" else OPTIONAL_KINDS["LeaderWorkerSet"][0]
                obj = await kube.get(api, rp.kind, owner.namespace, names.role(owner.name, rp.role))
            roles.append(RoleObservation(rp.role, rp.kind, rp.replicas, workload_ready_replicas(obj)))
        if spec.routing.enabled:
            epp_ready = await _available(kube, owner.namespace, names.epp(owner.name))
        if spec.engine.type == "sglang-jax":
            bootstrap_ready = await _available(kube, owner.namespace, names.pd_bootstrap(owner.name))
    except KubeError as e:
        return await finish_held(e)
    if plan.missing_kinds:
        p.again(60, missing_crd_message(plan.missing_kinds))
    routing_ready = spec.routing.enabled and epp_ready and "InferencePool" not in plan.missing_kinds
    obs = ServingObservation(roles=roles, routing_enabled=spec.routing.enabled, routing_ready=routing_ready,
                             pool_ready=pool_ready,
                             missing_kinds_message=missing_crd_message(plan.missing_kinds) if plan.missing_kinds else "",
                             issues=p.issues, pd_bootstrap_ready=bootstrap_ready)
    conds = merge_conditions(old.get("conditions"), serving_conditions(obs), gen, deps.now())
    role_status = {r.role: {"kind": r.kind, "replicas": r.replicas, "readyReplicas": r.ready_replicas} for r in roles}
    return await _finish(deps, p, owner.api_version, owner.kind, DisaggregatedServingStatus, {
        "observedGeneration": gen, "conditions": conds,
        "prefill": role_status.get("prefill"), "decode": role_status.get("decode"),
        "endpoint": _endpoint(owner, spec), "routingReady": routing_ready,
    })


async def _available(kube: Kube, namespace: str, deployment: str) -> bool:
    obj = await kube.get("apps/v1", "Deployment", namespace, deployment)
    return int(((obj or {}).get("status") or {}).get("availableReplicas", 0) or 0) > 0


async def _pd_secret(kube: Kube, p: _Pass, owner: Owner, deps: Deps) -> None:
    """sglang-jax's P/D shared secret, created once (like a pool's auth Secret)."""
    name = names.pd_secret(owner.name)
    if await kube.get("v1", "Secret", owner.namespace, name) is None and \
            await kube.create(sglang_pd.build_secret(owner, deps.token().hex())):
        p.event("Normal", "SecretGenerated", f"generated sglang-jax P/D secret {name}")


def _endpoint(owner: Owner, spec: DisaggregatedServingSpec) -> str:
    gw = spec.routing.gateway_ref
    if gw is not None and spec.routing.enabled:
        return f"gateway/{gw.namespace or owner.namespace}/{gw.name}"
    role = "decode" if spec.decode.replicas > 0 else "prefill"
    return f"http://{names.role(owner.name, role)}.{owner.namespace}.svc:{spec.port}"
