"""Children of a DisaggregatedServing: per-role workloads (Deployment or LeaderWorkerSet),
role Services and the serving NetworkPolicy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import versions
from ..models import DisaggregatedServingSpec, DiskTier, TPUSyncPoolSpec, VolumeSpec
from ..quantity import to_bytes
from ..tpu import TPU_RESOURCE, Slice
from . import names
from .common import (
    DISK_ANNOTATION,
    DRAM_ANNOTATION,
    LLMD_ROLE_LABEL,
    LLMD_SERVING_LABEL,
    POOL_LABEL,
    ROLE_LABEL,
    SERVING_LABEL,
    Owner,
    base_labels,
    metadata,
    resources,
    verbatim,
)
from .engine import (
    COMPILE_CACHE_DIR,
    WEIGHTS_DIR,
    ModelSource,
    MultiHost,
    engine_command,
    engine_env,
    engine_image,
    engine_ports,
    engine_probe_path,
    proxy_kv_connector,
)
from .pool import pool_node_selector, tpu_node_labels
from .security import container_security_context, pod_security_context, tpu_engine_security_context
from .sidecar import build_sidecar_container, build_sidecar_volumes

LWS_API = versions.LWS_API
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_EXCLUSIVE = "leaderworkerset.sigs.k8s.io/exclusive-topology"
PROXY_NAME = "routing-proxy"
# A terminating engine keeps serving this long before its SIGTERM: the time the pod's Services
# (kube-proxy's rules) and the endpoint picker take to stop sending it new requests, which they
# start doing when the pod is deleted, not when it exits. Without it a rollout's or a scale-down's
# requests of the next second meet a closed port. The sleep action (no sleep binary needed in
# the engine's image) needs Kubernetes 1.30: versions.GKE_KUBERNETES.
ENGINE_DRAIN_SECONDS = 5


@dataclass(frozen=True)
class PoolInfo:
    """What a serving needs to know about its TPUSyncPool."""
    name: str
    spec: TPUSyncPoolSpec
    tpu: Slice


@dataclass(frozen=True)
class RolePlan:
    """One role after planning: the workload kind, its shape and its pool."""
    role: str                # "prefill" | "decode"
    replicas: int
    hosts_per_replica: int
    chips_per_host: int      # 0 when the engine runs without TPUs (reference, cpuOnly)
    kind: str                # "Deployment" | "LeaderWorkerSet"
    pool: PoolInfo
    # The other role's pool when it is another one: its sidecars are this role's peers too.
    peer_pools: tuple[PoolInfo, ...] = ()

    @property
    def chips(self) -> int:
        return self.chips_per_host * self.hosts_per_replica


def uses_proxy(spec: DisaggregatedServingSpec, role: str) -> bool:
    """Decode pods run llm-d's routing proxy in front of the engine (P/D handshake)."""
    return role == "decode" and spec.routing.enabled


def engine_port(spec: DisaggregatedServingSpec, role: str) -> int:
    if not uses_proxy(spec, role):
        return spec.port
    return 8200 if spec.port != 8200 else 8201


def role_selector(owner: Owner, role: str) -> dict[str, str]:
    return {SERVING_LABEL: owner.name, ROLE_LABEL: role}


def unit_role(spec: DisaggregatedServingSpec) -> str:
    """The role whose serving pods stand for the units: the one with fewer replicas per unit
    (decode on a tie), one per unit when either role has one."""
    per_unit = {r: spec.role(r).replicas for r in ("decode", "prefill") if spec.role(r).replicas > 0}
    return min(per_unit, key=lambda r: per_unit[r])


def unit_pod_labels(owner: Owner, spec: DisaggregatedServingSpec) -> dict[str, str]:
    """The /scale subresource's selector: the serving pods (Deployment pods, LeaderWorkerSet
    leaders) of unit_role. The HPA scales to ceil(usage ratio x the pods it selects) units, so
    it must select one pod per unit, as LWS selects one pod (the leader) per group."""
    return {SERVING_LABEL: owner.name, ROLE_LABEL: unit_role(spec), LLMD_SERVING_LABEL: "true"}


def _tiers(spec: DisaggregatedServingSpec, pool: PoolInfo) -> tuple[int, DiskTier | None]:
    dram = to_bytes(spec.prefix_cache.host_dram or pool.spec.tiers.dram)
    base = pool.spec.tiers.disk
    size = spec.prefix_cache.disk or (base.size if base else None)
    if size is None:
        return dram, None
    return dram, DiskTier(size=size, medium=base.medium if base else "EmptyDir",
                          storage_class_name=base.storage_class_name if base else None)


ENGINE_TMP_BYTES = "2Gi"   # scratch only: weights and compiled programs have volumes of their own


def routing_proxy_args(spec: DisaggregatedServingSpec, engine_port_: int) -> list[str]:
    """llm-d's P/D proxy in front of the decode engine (flags: versions.ROUTING_PROXY)."""
    return [f"--port={spec.port}", f"--model-server-port={engine_port_}",
            f"--kv-connector={verbatim(proxy_kv_connector(spec))}", "--secure-proxy=false"]


def weights_read_only(spec: DisaggregatedServingSpec) -> bool:
    """A claim of pre-staged weights loaded by path is mounted read-only; downloads need it writable."""
    return spec.storage.weights.medium == "PersistentVolumeClaim" and ModelSource.of(spec.model).scheme == "path"


def _volume(name: str, vol: VolumeSpec, *, read_only: bool = False) -> dict[str, Any]:
    if vol.medium == "EphemeralVolume":
        return {"name": name, "ephemeral": {"volumeClaimTemplate": {"spec": {
            "accessModes": ["ReadWriteOnce"], "storageClassName": vol.storage_class_name,
            "resources": {"requests": {"storage": vol.size}}}}}}
    if vol.medium == "PersistentVolumeClaim":
        claim: dict[str, Any] = {"claimName": vol.claim_name}
        if read_only:
            claim["readOnly"] = True
        return {"name": name, "persistentVolumeClaim": claim}
    return {"name": name, "emptyDir": {"sizeLimit": vol.size}}


def engine_volumes(spec: DisaggregatedServingSpec) -> list[dict[str, Any]]:
    """The engine's scratch /tmp, weights (/models) and XLA compile cache (/cache/xla), sized
    by spec.storage: the sidecar's small /tmp would evict the pod, and unsized weights fill
    the node's boot disk."""
    return [{"name": "engine-tmp", "emptyDir": {"sizeLimit": ENGINE_TMP_BYTES}},
            _volume("model-weights", spec.storage.weights, read_only=weights_read_only(spec)),
            _volume("compile-cache", spec.storage.compile_cache)]


def engine_security_context(spec: DisaggregatedServingSpec, tpu: bool) -> dict[str, Any]:
    """The engine container's securityContext: as GKE documents TPU access for an engine with
    TPUs (common.tpu_engine_security_context), non-root otherwise, with the fields of
    spec.engine.securityContext in place of the operator's."""
    base = tpu_engine_security_context() if tpu else container_security_context(read_only_root=False)
    override = spec.engine.security_context
    return {**base, **override.dump()} if override is not None else base


def shared_layout(spec: DisaggregatedServingSpec, tensor_parallel: int) -> str:
    """What changes the bytes of a serving's KV blocks besides the block size, fingerprinted by the
    shared tier so that engines that differ in any of it never read each other's blocks: the
    weights (model and revision), the engine and its image (its KV layout), the tensor-parallel
    size. Prefill and decode of one serving agree on all of it unless their parallelism differs."""
    return ";".join(f"{k}={v}" for k, v in (
        ("model", spec.model.uri), ("revision", spec.model.revision or ""), ("engine", spec.engine.type),
        ("image", engine_image(spec)), ("tp", tensor_parallel)))


def build_pod_template(owner: Owner, spec: DisaggregatedServingSpec, plan: RolePlan, *,
                       serving: bool) -> dict[str, Any]:
    """Pod template of one role, on its pool. `serving` marks pods that take requests (a
    Deployment pod or an LWS leader): only those carry the llm-d labels the InferencePool and
    EPP select."""
    role, pool = plan.role, plan.pool
    dram, disk = _tiers(spec, pool)
    port = engine_port(spec, role)
    labels = {**base_labels(owner, role), POOL_LABEL: pool.name, SERVING_LABEL: owner.name, ROLE_LABEL: role}
    if serving:
        labels[LLMD_ROLE_LABEL] = role
        labels[LLMD_SERVING_LABEL] = "true"
    sidecar = build_sidecar_container(pool.name, owner.namespace, pool.spec, dram_bytes=dram, disk=disk, native=True,
                                      shared_layout=shared_layout(spec, pool.tpu.tensor_parallel(plan.chips)),
                                      peers=[f"{names.peers_dns(p.name, owner.namespace)}:{p.spec.sidecar.data_port}"
                                             for p in plan.peer_pools])
    init = [sidecar]
    if uses_proxy(spec, role) and serving:
        init.append(_proxy_container(spec, port))
    node_selector = pool_node_selector(pool.name, owner.namespace, pool.spec, pool.tpu)
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": pod_security_context(),
        "initContainers": init,
        "containers": [_engine_container(owner, spec, plan, port=port, serving=serving)],
        "volumes": build_sidecar_volumes(pool.name, pool.spec, shm_bytes=dram + to_bytes("1Gi"), disk=disk, shared=True)
        + engine_volumes(spec),
    }
    if plan.chips_per_host:
        node_selector = {**node_selector, **tpu_node_labels(pool.tpu)}
        pod["tolerations"] = [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if node_selector:
        pod["nodeSelector"] = node_selector
    annotations = {DRAM_ANNOTATION: str(dram), DISK_ANNOTATION: str(to_bytes(disk.size) if disk else 0)}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod}


def _engine_container(owner: Owner, spec: DisaggregatedServingSpec, plan: RolePlan, *, port: int,
                      serving: bool) -> dict[str, Any]:
    """The role's engine: its command, ports, probes (none on a multi-host follower), the
    sidecar's shared memory and socket, its TPU chips."""
    role, pool = plan.role, plan.pool
    multi_host: MultiHost = None if plan.hosts_per_replica == 1 else ("leader" if serving else "worker")
    command, args = engine_command(owner, spec, role, port=port, tensor_parallel=pool.tpu.tensor_parallel(plan.chips),
                                   data_port=pool.spec.sidecar.data_port,
                                   kv_events_port=pool.spec.sidecar.kv_events_port, multi_host=multi_host,
                                   hosts=plan.hosts_per_replica)
    # A worker of a multi-host replica (vLLM's Ray worker, a reference engine's follower) serves no
    # HTTP: the leader's probes speak for the group.
    follower = spec.engine.type in ("vllm-tpu", "reference") and multi_host == "worker"
    engine: dict[str, Any] = {
        "name": "engine",
        "image": engine_image(spec),
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": command,
        "args": args,
        "env": engine_env(owner, spec, role, data_port=pool.spec.sidecar.data_port, multi_host=multi_host),
        # The engine publishes the KV events (it knows each block's tokens).
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"},
                  {"name": "kv-events", "containerPort": pool.spec.sidecar.kv_events_port, "protocol": "TCP"},
                  *({"name": n, "containerPort": p, "protocol": "TCP"} for n, p in engine_ports(spec).items())],
        **({} if follower else {
            "startupProbe": {"httpGet": {"path": engine_probe_path(spec), "port": port},
                             "periodSeconds": 10, "failureThreshold": 360},
            "readinessProbe": {"httpGet": {"path": engine_probe_path(spec), "port": port},
                               "periodSeconds": 5, "failureThreshold": 3},
            "lifecycle": {"preStop": {"sleep": {"seconds": ENGINE_DRAIN_SECONDS}}}}),
        "securityContext": engine_security_context(spec, tpu=plan.chips_per_host > 0),
        "volumeMounts": [
            {"name": "tpusync-shm", "mountPath": "/dev/shm"},
            {"name": "tpusync-run", "mountPath": "/run/tpusync"},
            {"name": "engine-tmp", "mountPath": "/tmp"},
            {"name": "model-weights", "mountPath": WEIGHTS_DIR,
             **({"readOnly": True} if weights_read_only(spec) else {})},
            {"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR},
        ],
    }
    tpu_request = {TPU_RESOURCE: str(plan.chips_per_host)} if plan.chips_per_host else {}
    res = resources(spec.role(role).resources, tpu_request)
    if res:
        engine["resources"] = res
    return engine


def _proxy_container(spec: DisaggregatedServingSpec, port: int) -> dict[str, Any]:
    """The routing proxy in front of a serving pod's engine (a native sidecar: restartPolicy Always)."""
    return {
        "name": PROXY_NAME,
        "image": spec.routing.proxy_image,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "args": routing_proxy_args(spec, port),  # the engine's port, behind it
        "ports": [{"name": "proxy", "containerPort": spec.port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": spec.port}, "periodSeconds": 5},
        "securityContext": container_security_context(read_only_root=True),
    }


def _workload_labels(owner: Owner, plan: RolePlan) -> dict[str, str]:
    return {**base_labels(owner, plan.role), POOL_LABEL: plan.pool.name, SERVING_LABEL: owner.name,
            ROLE_LABEL: plan.role}


def _lws_annotations(plan: RolePlan) -> dict[str, str] | None:
    """A multi-host group takes a node pool (its slice) of its own; single-host groups share one."""
    return {LWS_EXCLUSIVE: "cloud.google.com/gke-nodepool"} if plan.chips_per_host and plan.hosts_per_replica > 1 \
        else None


def _lws_spec(owner: Owner, spec: DisaggregatedServingSpec, plan: RolePlan) -> dict[str, Any]:
    """A LeaderWorkerSet's spec: groups of hosts_per_replica pods. A group of one is its leader
    alone, made from the worker template (LWS uses it when there is no leader template)."""
    r = spec.rollout
    group: dict[str, Any] = {"size": plan.hosts_per_replica, "restartPolicy": "RecreateGroupOnPodRestart"}
    if plan.hosts_per_replica > 1:
        group["leaderTemplate"] = build_pod_template(owner, spec, plan, serving=True)
    group["workerTemplate"] = build_pod_template(owner, spec, plan, serving=plan.hosts_per_replica == 1)
    return {"replicas": plan.replicas,
            "startupPolicy": "LeaderCreated",
            # A headless Service per group, named after its leader pod: with the default (Shared)
            # LWS takes the set's own name for it, which is the role Service's name
            # (versions.LWS_NETWORK_SOURCE).
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": r.max_unavailable,
                                                               "maxSurge": r.max_surge}},
            "leaderWorkerTemplate": group}


def build_role_workload(owner: Owner, spec: DisaggregatedServingSpec, plan: RolePlan) -> dict[str, Any]:
    """A Deployment (one host per replica) or a LeaderWorkerSet (multi-host replicas)."""
    name = names.role(owner.name, plan.role)
    labels = _workload_labels(owner, plan)
    if plan.kind == "Deployment":
        r = spec.rollout
        return {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": metadata(owner, name, labels),
                "spec": {"replicas": plan.replicas,
                         "selector": {"matchLabels": role_selector(owner, plan.role)},
                         "strategy": {"type": "RollingUpdate",
                                      "rollingUpdate": {"maxSurge": r.max_surge, "maxUnavailable": r.max_unavailable}},
                         "template": build_pod_template(owner, spec, plan, serving=True)}}
    return {"apiVersion": LWS_API, "kind": "LeaderWorkerSet",
            "metadata": metadata(owner, name, labels, _lws_annotations(plan)),
            "spec": _lws_spec(owner, spec, plan)}


def build_disaggregated_set(owner: Owner, spec: DisaggregatedServingSpec, plans: list[RolePlan]) -> dict[str, Any]:
    """spec.rollout.strategy Lockstep: both roles in one DisaggregatedSet (versions.DISAGGREGATEDSET_SOURCES),
    each a LeaderWorkerSet per revision (single-host replicas are groups of one), rolled as a pair."""
    roles = [{"name": p.role,
              "metadata": {"labels": _workload_labels(owner, p),
                           **({"annotations": a} if (a := _lws_annotations(p)) else {})},
              "spec": _lws_spec(owner, spec, p)} for p in plans]
    return {"apiVersion": versions.DISAGGREGATEDSET_API, "kind": "DisaggregatedSet",
            "metadata": metadata(owner, names.disaggregated_set(owner.name), base_labels(owner, "engine")),
            "spec": {"roles": roles}}


def build_role_service(owner: Owner, spec: DisaggregatedServingSpec, role: str) -> dict[str, Any]:
    """ClusterIP Service of a role's serving pods (LWS leaders only)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(owner, names.role(owner.name, role), {**base_labels(owner, role),
                                                                       SERVING_LABEL: owner.name}),
            "spec": {"selector": {**role_selector(owner, role), LLMD_SERVING_LABEL: "true"},
                     "ports": [{"name": "http", "port": spec.port, "targetPort": spec.port, "protocol": "TCP"}]}}


def build_serving_network_policy(owner: Owner, spec: DisaggregatedServingSpec) -> dict[str, Any]:
    """Open the serving port of this serving's pods to clients (gateway, proxy), and every port
    between the serving's own pods (LWS leader and workers, decode proxy to prefill, the EPP
    scraping engines). The pool's policy keeps the data port closed to everyone else."""
    def own_pods() -> dict[str, Any]:
        return {"matchLabels": {SERVING_LABEL: owner.name}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(owner, names.serving_netpol(owner.name), base_labels(owner, "network-policy")),
            "spec": {"podSelector": own_pods(),
                     "policyTypes": ["Ingress"],
                     "ingress": [{"ports": [{"protocol": "TCP", "port": spec.port}]},
                                 {"from": [{"podSelector": own_pods()}]}]}}
