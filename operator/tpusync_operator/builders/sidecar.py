"""The tpusync-sidecar container and its volumes (shared by store nodes and serving pods)."""

from __future__ import annotations

from typing import Any

from .. import versions
from ..models import DiskTier, SharedTier, TPUSyncPoolSpec
from ..quantity import to_bytes
from . import names
from .common import env_from_fields, resources
from .security import container_security_context

SHM_DIR = "/dev/shm"
POOL_PATH = "/dev/shm/tpusync-pool"
RUN_DIR = "/run/tpusync"
CONTROL_SOCKET = "/run/tpusync/control.sock"
DISK_DIR = "/var/lib/tpusync/disk"
SHARED_DIR = "/var/lib/tpusync/shared"
AUTH_DIR = "/etc/tpusync/auth"
CONTAINER_NAME = "tpusync-sidecar"
# The disk tier's file holds one header page per block beside the block (kHeaderBytes in
# native/src/store/disk_tier.cc), and the directory a few small files (tier.meta, tier.lock).
DISK_EXTENT_HEADER = 4096
DISK_DIR_RESERVE = 1 << 20


POOL_SLOT_META = 64           # per slot (BlockPool::SlotMeta, native/src/store/block_pool.cc)
POOL_ALIGN = 2 << 20          # the pool's data and its end on huge-page boundaries (kHugePageBytes)


def pool_file_bytes(dram_bytes: int, block_bytes: int) -> int:
    """The size of the DRAM tier's file for --dram-bytes (block_pool.cc: a header page, a slot
    table, the slots): what its memory-backed /dev/shm must hold."""
    def align(n: int) -> int:
        return -(-n // POOL_ALIGN) * POOL_ALIGN
    slots = dram_bytes // block_bytes
    return align(align(4096 + slots * POOL_SLOT_META) + slots * block_bytes)


def disk_tier_bytes(size: int, block_bytes: int) -> int:
    """--disk-bytes (payload) for a tier whose files must fit in a volume of `size` bytes: an
    emptyDir past its sizeLimit gets the pod evicted, a full claim fails the sidecar."""
    return max(0, (size - DISK_DIR_RESERVE) // (block_bytes + DISK_EXTENT_HEADER)) * block_bytes


def build_sidecar_container(pool: str, namespace: str, spec: TPUSyncPoolSpec, *, dram_bytes: int,
                            disk: DiskTier | None, native: bool, shared_layout: str | None = None,
                            peers: list[str] | None = None) -> dict[str, Any]:
    """The sidecar container; `native` makes it a native sidecar (init container, restartPolicy Always).
    With `shared_layout` (what changes the bytes of its engines' blocks) it mounts the pool's
    shared tier, when the pool has one. `peers` (host:port) are members of other pools it may
    dial besides its own pool's: those of a serving's other role on a pool of its own."""
    sc = spec.sidecar
    args = [
        "--bind=0.0.0.0",  # the pod's interfaces; the NetworkPolicy admits only pool members
        f"--data-port={sc.data_port}",
        f"--http-port={sc.http_port}",
        f"--control-socket={CONTROL_SOCKET}",
        f"--pool-path={POOL_PATH}",
        f"--dram-bytes={dram_bytes}",
        f"--block-bytes={to_bytes(spec.tiers.block_bytes)}",
        f"--auth-secret-file={AUTH_DIR}/token",
        f"--peers-dns={names.peers_dns(pool, namespace)}",
        *([f"--peers={','.join(peers)}"] if peers else []),
        *(["--encrypt"] if sc.encrypt else []),
    ]
    mounts = [
        {"name": "tpusync-shm", "mountPath": SHM_DIR},
        {"name": "tpusync-run", "mountPath": RUN_DIR},
        {"name": "tpusync-tmp", "mountPath": "/tmp"},
        {"name": "tpusync-auth", "mountPath": AUTH_DIR, "readOnly": True},
    ]
    if disk is not None:
        args += [f"--disk-dir={DISK_DIR}",
                 f"--disk-bytes={disk_tier_bytes(to_bytes(disk.size), to_bytes(spec.tiers.block_bytes))}"]
        mounts.append({"name": "tpusync-disk", "mountPath": DISK_DIR})
    shared = spec.tiers.shared
    if shared is not None and shared_layout is not None:
        args += shared_tier_args(shared, shared_layout)
        mounts.append({"name": "tpusync-shared", "mountPath": SHARED_DIR})
    env = env_from_fields()

    def probe(path: str, **extra: Any) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "sidecar-http"}, "periodSeconds": 5, **extra}

    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": versions.from_registry(sc.image),   # the chart's imageRegistry, for tpusync's images
        "imagePullPolicy": sc.image_pull_policy,
        "command": ["tpusync-sidecar"],
        "args": args,
        "env": env,
        "ports": [
            {"name": "tpusync-data", "containerPort": sc.data_port, "protocol": "TCP"},
            {"name": "sidecar-http", "containerPort": sc.http_port, "protocol": "TCP"},
        ],
        "startupProbe": probe("/healthz", failureThreshold=60),
        "livenessProbe": probe("/healthz", failureThreshold=3),
        "readinessProbe": probe("/readyz", failureThreshold=2),
        "securityContext": container_security_context(read_only_root=True),
        "volumeMounts": mounts,
    }
    res = resources(sc.resources)
    if res:
        container["resources"] = res
    if native:
        container["restartPolicy"] = "Always"
    return container


def shared_tier_args(shared: SharedTier, layout: str) -> list[str]:
    return [f"--shared-dir={SHARED_DIR}", f"--shared-layout={layout}",
            f"--shared-bytes={to_bytes(shared.capacity) if shared.capacity else 0}",
            f"--shared-policy={'demote' if shared.policy == 'Demote' else 'write-through'}",
            f"--shared-high-watermark-percent={shared.high_watermark_percent}",
            f"--shared-low-watermark-percent={shared.low_watermark_percent}"]


def shared_claim_name(pool: str, shared: SharedTier) -> str:
    return shared.claim_name or names.pool_shared_claim(pool)


def build_sidecar_volumes(pool: str, spec: TPUSyncPoolSpec, *, shm_bytes: int,
                          disk: DiskTier | None, shared: bool = False) -> list[dict[str, Any]]:
    """Volumes the sidecar mounts. No hostPath: memory-backed emptyDir for the zero-copy pool."""
    volumes: list[dict[str, Any]] = [
        {"name": "tpusync-shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(shm_bytes)}},
        {"name": "tpusync-run", "emptyDir": {"sizeLimit": "16Mi"}},
        {"name": "tpusync-tmp", "emptyDir": {"sizeLimit": "256Mi"}},
        {"name": "tpusync-auth", "secret": {"secretName": names.pool_auth(pool, spec), "defaultMode": 0o440}},
    ]
    if disk is not None:
        if disk.medium == "EphemeralVolume":
            volumes.append({"name": "tpusync-disk", "ephemeral": {"volumeClaimTemplate": {"spec": {
                "accessModes": ["ReadWriteOnce"], "storageClassName": disk.storage_class_name,
                "resources": {"requests": {"storage": disk.size}}}}}})
        else:
            volumes.append({"name": "tpusync-disk", "emptyDir": {"sizeLimit": disk.size}})
    if shared and spec.tiers.shared is not None:
        volumes.append({"name": "tpusync-shared",
                        "persistentVolumeClaim": {"claimName": shared_claim_name(pool, spec.tiers.shared)}})
    return volumes
