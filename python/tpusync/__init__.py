"""tpusync: move KV-cache blocks and weights between accelerators, host DRAM, disk and hosts."""

import importlib
from typing import Any

from tpusync import errors
from tpusync.errors import (
    CapacityError,
    CorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PreconditionError,
    StorageIOError,
    TpuSyncError,
)
from tpusync.store import KVStore, LookupResult, Tier, connect_sidecar

__all__ = [
    "CapacityError",
    "CorruptionError",
    "InvalidArgumentError",
    "KVCacheManager",
    "KVCacheStore",
    "KVStore",
    "LookupResult",
    "NotFoundError",
    "PageMover",
    "PreconditionError",
    "PrefixStore",
    "StorageIOError",
    "Tier",
    "TpuSyncError",
    "TransferStatus",
    "VersionedWeights",
    "WeightDistributor",
    "WeightSynchronizer",
    "connect_sidecar",
    "errors",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The JAX-facing API loads JAX only when asked for: the block store needs numpy alone.
    upstream_modules = {"KVCacheManager": "kv_cache_manager", "KVCacheStore": "kv_cache_store",
                        "WeightSynchronizer": "weight_synchronizer"}
    if name in upstream_modules:  # upstream TPU Sync's names: its semantics
        return getattr(importlib.import_module(f"tpusync.engines.upstream.{upstream_modules[name]}"), name)
    if name in ("PageMover", "PrefixStore", "TransferStatus"):
        from tpusync.kv import cache

        return getattr(cache, name)
    if name in ("VersionedWeights", "WeightDistributor"):
        from tpusync import weights

        return getattr(weights, name)
    raise AttributeError(f"module 'tpusync' has no attribute {name!r}")
