"""A DisaggregatedServing's plan, pure: from its spec and its pools to the children to apply
and delete (`plan_serving`), and the spec rules the schema cannot express. No I/O;
reconcile_serving executes the plan.

`ServingPlan` holds the children to server-side apply (Kubernetes objects, as the builders
render them) and `Ref`s of the children to delete; a plan only names children of its owner."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .builders import llmd, names, sglang_pd
from .builders import serving as serving_builders
from .builders.common import Owner
from .builders.serving import PoolInfo, RolePlan
from .models import (
    DECODE_CLAMPED_OFF,
    ENGINE_NONROOT_UID,
    ENGINE_PRIVILEGED_ESCALATION,
    GS_NEEDS_VLLM,
    LENGTH_NEEDS_VLLM,
    LOCKSTEP_ALL_OR_NONE,
    LOCKSTEP_NEEDS_BOTH_ROLES,
    MAX_MODEL_LEN_BEYOND_SCALING,
    MAX_MODEL_LEN_TOO_LONG,
    MAX_MODEL_LEN_UNDECLARED,
    NO_ROLE_RUNS,
    PROXY_SGLANG_PAIR,
    REVISION_NEEDS_WEIGHTS,
    ROLE_POOLS_BOTH,
    SGLANG_IMAGE_REQUIRED,
    SGLANG_ONE_PREFILL,
    SGLANG_SINGLE_HOST,
    DisaggregatedServingSpec,
    RoleSpec,
)
from .pool_plan import Child, PlanError, Ref, pool_hosts
from .quantity import to_bytes

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


def check_lockstep(spec: DisaggregatedServingSpec) -> None:
    if spec.prefill.replicas == 0 or spec.decode.replicas == 0:     # the schema refuses it too
        raise PlanError(LOCKSTEP_NEEDS_BOTH_ROLES)


def check_serving_name(owner: Owner, spec: DisaggregatedServingSpec, roles: list[RolePlan]) -> None:
    """Every child's name derives from the serving's within what Kubernetes and LWS admit. The
    schema refuses the same, but sees a multi-host role only by its hostsPerReplica, not by
    its pool's topology."""
    lockstep = spec.rollout.strategy == "Lockstep"
    multi_host = any(r.hosts_per_replica > 1 for r in roles)
    limit = names.serving_name_max(sglang=spec.engine.type == "sglang-jax", multi_host=multi_host,
                                   lockstep=lockstep)
    if len(owner.name) <= limit:
        return
    bootstrap = ", <name>-pd-bootstrap" if spec.engine.type == "sglang-jax" else ""
    why = ("with spec.rollout.strategy Lockstep (its LeaderWorkerSets are <name>-<revision>-<role>, and the "
           "StatefulSets LWS derives from them, <lws>-<group>, must have names of at most "
           f"{names.STATEFULSET_MAX})" if lockstep else
           f"with multi-host roles (each role's LeaderWorkerSet has StatefulSets <name>-<role>-<group>, whose names "
           f"must be at most {names.STATEFULSET_MAX} characters)" if multi_host else
           f"(its Services <name>-prefill, <name>-epp{bootstrap} must have names of at most {names.LABEL_MAX})")
    raise PlanError(f"metadata.name: at most {limit} characters {why}, not {len(owner.name)}")


def _role_off(r: RoleSpec) -> bool:
    """The role runs no replica at any spec.replicas of 1 or more."""
    return r.max_replicas == 0 or (r.replicas == 0 and not r.min_replicas)


def check_role_bounds(spec: DisaggregatedServingSpec) -> None:
    """Replica bounds that leave the serving unable to serve, or that LWS or sglang-jax refuse
    (the schema refuses each of them too)."""
    p, d = spec.prefill, spec.decode
    if d.max_replicas == 0 and d.replicas > 0:
        raise PlanError(DECODE_CLAMPED_OFF)
    if _role_off(p) and _role_off(d):
        raise PlanError(NO_ROLE_RUNS)
    if spec.rollout.strategy == "Lockstep" and (bool(p.min_replicas) != bool(d.min_replicas)
                                                 or p.max_replicas == 0 or d.max_replicas == 0):
        raise PlanError(LOCKSTEP_ALL_OR_NONE)
    if spec.engine.type == "sglang-jax" and role_replicas(spec, "prefill") > 1:
        raise PlanError(SGLANG_ONE_PREFILL)


# The page size, in tokens, of the KV blocks an engine announces to llm-d: the option of the
# role's args that sets it, or the engine's own (None: vllm-tpu's, which tpu-inference picks
# per model and attention kernel, is not known before it runs). sglang-jax publishes no KV
# events (the schema refuses precise routing with it).
REFERENCE_PAGE_SIZE = 32   # tpusync.engines.reference.model.ModelConfig.page_size


def page_size(spec: DisaggregatedServingSpec, role: str) -> tuple[int | None, str]:
    """(the role's page size in tokens or None when not known, where it comes from)."""
    options = option_values(spec.role(role).args or [])
    if spec.engine.type == "vllm-tpu":
        given = options.get("--block-size")
        return (int(given) if given and given.isdigit() else None), f"spec.{role}.args --block-size"
    if spec.engine.type == "reference":
        config = _layout_value("reference", "--model-config", options.get("--model-config"))
        given = json.loads(options["--model-config"]).get("page_size") if isinstance(config, dict) else None
        if given is None:
            return REFERENCE_PAGE_SIZE, "the reference engine's page"
        return (given if isinstance(given, int) else None), f"spec.{role}.args --model-config page_size"
    return None, ""


def check_block_size_tokens(spec: DisaggregatedServingSpec) -> None:
    """llm-d's blockSizeTokens divides every engine's page size, or blocks drop out of its index
    (docs/block-keys.md)."""
    r = spec.routing
    if not (r.enabled and r.precise_prefix_cache):
        return
    for role in ROLES:
        size, source = page_size(spec, role)
        if size is not None and size % r.block_size_tokens:
            raise PlanError(f"spec.routing.blockSizeTokens {r.block_size_tokens} must divide the page size of every "
                            f"engine of the serving, and {source} is {size} tokens: pages that are not whole "
                            f"blocks of llm-d's index drop out of it (docs/block-keys.md)")


def plan_serving(owner: Owner, spec: DisaggregatedServingSpec, pool: PoolInfo, available_kinds: set[str],
                 role_pools: dict[str, PoolInfo] | None = None) -> ServingPlan:
    """available_kinds: the optional kinds (OPTIONAL_KINDS) served by the cluster; role_pools: the
    pool of each role with a spec.<role>.poolRef of its own (spec.poolRef's `pool` runs the others)."""
    check_spec(spec)
    roles = plan_roles(spec, pool, role_pools)
    check_serving_name(owner, spec, roles)
    required = required_kinds(spec, roles)
    missing = sorted(required - available_kinds)
    apply, delete = role_children(owner, spec, roles, available_kinds, missing)
    routed = routing_children(owner, spec, roles, available_kinds, missing)
    return ServingPlan(roles=roles, apply=apply + routed[0], delete=delete + routed[1], missing_kinds=missing,
                       required_kinds=sorted(required))


def check_spec(spec: DisaggregatedServingSpec) -> None:
    """Every check of a serving's spec alone (most the schema makes too): PlanError names the field."""
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
    check_role_bounds(spec)
    check_block_size_tokens(spec)
    if spec.routing.proxy_kv_connector is not None and \
            (spec.routing.proxy_kv_connector == "sglang") != (spec.engine.type == "sglang-jax"):   # and this
        raise PlanError(PROXY_SGLANG_PAIR)
    if spec.rollout.strategy == "Lockstep":
        check_lockstep(spec)


def required_kinds(spec: DisaggregatedServingSpec, roles: list[RolePlan]) -> set[str]:
    """The optional kinds (OPTIONAL_KINDS) this serving's children need."""
    required: set[str] = {p.kind for p in roles if p.kind == "LeaderWorkerSet"}
    if spec.rollout.strategy == "Lockstep":
        required.add("DisaggregatedSet")
    if spec.routing.enabled:
        required |= {"InferencePool", "InferenceObjective"}
        if spec.routing.gateway_ref is not None:
            required.add("HTTPRoute")
        if spec.routing.gke_gateway_policies:
            required |= set(GKE_POLICY_KINDS)
    return required


def role_children(owner: Owner, spec: DisaggregatedServingSpec, roles: list[RolePlan], available_kinds: set[str],
                  missing: list[str]) -> tuple[list[Child], list[Ref]]:
    """The roles' workloads and Services (or the DisaggregatedSet over them, in lockstep), the
    serving's NetworkPolicy and SGLang's bootstrap; and the workloads of another kind to delete."""
    lockstep = spec.rollout.strategy == "Lockstep"
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
    return apply, delete


def routing_children(owner: Owner, spec: DisaggregatedServingSpec, roles: list[RolePlan], available_kinds: set[str],
                     missing: list[str]) -> tuple[list[Child], list[Ref]]:
    """llm-d's objects for a routed serving (the endpoint picker and its RBAC, the
    InferencePool, InferenceObjective, HTTPRoute, GKE's policies); those no longer wanted to delete."""
    apply: list[Child] = []
    delete: list[Ref] = []
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
    return apply, delete
