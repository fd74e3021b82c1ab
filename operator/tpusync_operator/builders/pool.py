"""Children of a TPUSyncPool: shared config, auth Secret, peer Service, NetworkPolicy,
store nodes, and the GKE node pool request body."""

from __future__ import annotations

import base64
from typing import Any

from ..models import TPUSyncPoolSpec
from ..quantity import to_bytes
from ..tpu import ACCELERATOR_LABEL, NODEPOOL_LABEL, TOPOLOGY_LABEL, Slice
from . import names
from .common import DISK_ANNOTATION, DRAM_ANNOTATION, MANAGED_BY, POOL_LABEL, Owner, base_labels, metadata, resources
from .security import pod_security_context
from .sidecar import build_sidecar_container, build_sidecar_volumes, pool_file_bytes


def pool_labels(owner: Owner, component: str) -> dict[str, str]:
    return {**base_labels(owner, component), POOL_LABEL: owner.name}


NAMESPACE_LABEL = "tpusync.dev/namespace"   # on the nodes of a GKE node pool the operator creates
# The mark of a GKE node pool the operator created, in its labels (config.labels) with the two above.
MANAGED_BY_LABEL = "tpusync.dev/managed-by"
OWNER_UID_LABEL = "tpusync.dev/owner-uid"
NODE_POOL_MARK_KEYS = (MANAGED_BY_LABEL, OWNER_UID_LABEL)


def node_pool_mark(owner: Owner) -> dict[str, str]:
    """The labels every GKE node pool the operator creates carries, naming the TPUSyncPool it
    is for by uid: a node pool without them is never adopted, resized or deleted (a name in a
    spec must not hand someone else's node pool to the operator)."""
    return {MANAGED_BY_LABEL: MANAGED_BY, OWNER_UID_LABEL: owner.uid}


def node_pool_marked(node_pool: dict[str, Any], mark: dict[str, str]) -> bool:
    """Whether a NodePool (GKE's JSON) carries the mark (`node_pool_mark`)."""
    labels = (node_pool.get("config") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in mark.items())


def gke_slices(spec: TPUSyncPoolSpec, tpu: Slice) -> int:
    """How many GKE node pools a pool has: one per multi-host slice it may run (GKE creates and
    autoscales each atomically), else one."""
    cap = spec.capacity
    hosts = cap.autoscaling.max_hosts if cap.autoscaling is not None else cap.hosts
    if spec.provisioning.mode != "gke" or not tpu.multi_host or hosts is None:
        return 1
    return max(1, hosts // tpu.hosts)


def pool_node_selector(pool: str, namespace: str, spec: TPUSyncPoolSpec, tpu: Slice) -> dict[str, str]:
    """Labels that select the pool's hosts: in mode gke its node pool, or, with several slices
    (a node pool each), the labels the operator puts on every node it creates."""
    if spec.provisioning.mode == "gke":
        if gke_slices(spec, tpu) == 1:
            return {NODEPOOL_LABEL: names.gke_node_pool(pool, spec)}
        return {POOL_LABEL: pool, NAMESPACE_LABEL: namespace}
    existing = spec.provisioning.existing
    selector: dict[str, str] = dict(existing.node_selector or {}) if existing else {}
    if existing and existing.node_pool_name:
        selector[NODEPOOL_LABEL] = existing.node_pool_name
    return selector


def build_auth_secret(owner: Owner, spec: TPUSyncPoolSpec, token: bytes) -> dict[str, Any]:
    """The generated auth Secret. The caller creates it once and never rewrites it."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": metadata(owner, names.pool_auth(owner.name, spec), pool_labels(owner, "auth")),
            "data": {"token": base64.b64encode(token).decode()}}


def build_shared_claim(owner: Owner, spec: TPUSyncPoolSpec) -> dict[str, Any] | None:
    """The shared tier's ReadWriteMany claim, when the operator creates it (storageClassName)."""
    shared = spec.tiers.shared
    if shared is None or shared.storage_class_name is None:
        return None
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": metadata(owner, names.pool_shared_claim(owner.name), pool_labels(owner, "shared-tier")),
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": shared.storage_class_name,
                     "resources": {"requests": {"storage": shared.size}}}}


def build_peers_service(owner: Owner, spec: TPUSyncPoolSpec) -> dict[str, Any]:
    """Headless Service: DNS A records of every pool member, ready or not (peer discovery)."""
    sc = spec.sidecar
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(owner, names.pool_peers(owner.name), pool_labels(owner, "peers")),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {POOL_LABEL: owner.name},
                     "ports": [{"name": "tpusync-data", "port": sc.data_port, "targetPort": "tpusync-data"},
                               {"name": "sidecar-http", "port": sc.http_port, "targetPort": "sidecar-http"}]}}


def build_network_policy(owner: Owner, spec: TPUSyncPoolSpec) -> dict[str, Any]:
    """Only pool members (store nodes and the pool's serving pods, all labelled with the pool)
    reach the data port; KV events (token ids) only from this namespace; the sidecar's HTTP
    port (health, metrics) from anywhere. Serving pods get their engine ports from the
    DisaggregatedServing's own policy (policies are additive)."""
    sc = spec.sidecar
    members = {"podSelector": {"matchLabels": {POOL_LABEL: owner.name}}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(owner, names.pool_netpol(owner.name), pool_labels(owner, "network-policy")),
            "spec": {"podSelector": {"matchLabels": {POOL_LABEL: owner.name}},
                     "policyTypes": ["Ingress"],
                     "ingress": [
                         {"from": [members], "ports": [{"protocol": "TCP", "port": sc.data_port}]},
                         {"from": [{"podSelector": {}}],
                          "ports": [{"protocol": "TCP", "port": sc.kv_events_port}]},
                         {"ports": [{"protocol": "TCP", "port": sc.http_port}]},
                     ]}}


STORE_MEMORY_HEADROOM = to_bytes("512Mi")  # the sidecar process itself, beside its DRAM tier


def build_store_nodes(owner: Owner, spec: TPUSyncPoolSpec) -> dict[str, Any]:
    """Store nodes: standalone sidecars lending DRAM and disk as a lower tier."""
    store = spec.store_nodes
    dram = to_bytes(store.dram)
    disk = store.disk
    labels = pool_labels(owner, "store")
    selector = {POOL_LABEL: owner.name, "app.kubernetes.io/component": "store"}
    container = build_sidecar_container(owner.name, owner.namespace, spec, dram_bytes=dram, disk=disk, native=False)
    res = resources(store.resources)
    # The DRAM tier lives in a memory-backed /dev/shm, charged to this pod: unless told
    # otherwise, request it so the scheduler does not overcommit the node.
    if "memory" not in res.get("requests", {}):
        res.setdefault("requests", {})["memory"] = str(dram + STORE_MEMORY_HEADROOM)
    container["resources"] = res
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": build_sidecar_volumes(owner.name, spec, disk=disk,
                                         shm_bytes=pool_file_bytes(dram, to_bytes(spec.tiers.block_bytes))),
    }
    if store.node_selector:
        pod_spec["nodeSelector"] = dict(store.node_selector)
    template = {"metadata": {"labels": labels,
                             "annotations": {DRAM_ANNOTATION: str(dram),
                                             DISK_ANNOTATION: str(to_bytes(disk.size) if disk else 0)}},
                "spec": pod_spec}
    body: dict[str, Any] = {"selector": {"matchLabels": selector}, "template": template}
    if store.kind == "StatefulSet":
        body = {"serviceName": names.pool_peers(owner.name), "podManagementPolicy": "Parallel",
                "replicas": 1 if store.replicas is None else store.replicas, **body}
    return {"apiVersion": "apps/v1", "kind": store.kind,
            "metadata": metadata(owner, names.pool_store(owner.name), labels), "spec": body}


def build_node_pool_request(owner: Owner, spec: TPUSyncPoolSpec, tpu: Slice, slice_index: int = 0) -> dict[str, Any]:
    """Body of POST .../clusters/C/nodePools (GKE API v1) for one slice. Multi-host slices are
    created atomically with a COMPACT placement: tpuTopology for v6e, a workload policy for
    v7x; a pool of several multi-host slices has one node pool per slice."""
    gke = spec.provisioning.gke
    assert gke is not None
    cap = spec.capacity
    config: dict[str, Any] = {
        "machineType": tpu.machine_type,
        "labels": {POOL_LABEL: owner.name, NAMESPACE_LABEL: owner.namespace, **node_pool_mark(owner)},
        "spot": cap.spot,
    }
    if gke.service_account:
        config["serviceAccount"] = gke.service_account
    if cap.reservation:
        config["reservationAffinity"] = {"consumeReservationType": "SPECIFIC_RESERVATION",
                                         "key": "compute.googleapis.com/reservation-name",
                                         "values": [cap.reservation]}
    node_pool: dict[str, Any] = {"name": names.gke_node_pool(owner.name, spec, slice_index), "config": config}
    if gke.node_locations:
        node_pool["locations"] = list(gke.node_locations)
    hosts = cap.hosts if cap.hosts is not None else tpu.hosts
    if cap.autoscaling is not None:
        low, high = cap.autoscaling.min_hosts, cap.autoscaling.max_hosts
        if tpu.multi_host:      # the first minHosts/hosts slices stay up; the others GKE grows when pods wait
            low, high = (tpu.hosts if slice_index < low // tpu.hosts else 0), tpu.hosts
        node_pool["initialNodeCount"] = low
        node_pool["autoscaling"] = {"enabled": True, "minNodeCount": low, "maxNodeCount": high}
    else:
        node_pool["initialNodeCount"] = tpu.hosts if tpu.multi_host else hosts
    if tpu.multi_host:
        placement: dict[str, Any] = {"type": "COMPACT"}
        if tpu.tpu_type == "v7x":
            placement["policyName"] = gke.workload_policy
        else:
            placement["tpuTopology"] = tpu.topology
        node_pool["placementPolicy"] = placement
    return {"nodePool": node_pool}


def tpu_node_labels(tpu: Slice) -> dict[str, str]:
    return {ACCELERATOR_LABEL: tpu.accelerator, TOPOLOGY_LABEL: tpu.topology}
