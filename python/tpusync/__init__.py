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
from tpusync.store import KVStore, LookupResult, Tier

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
    "WeightSynchronizer",
    "WeightSynchronizerManager",
    "errors",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The JAX-facing API loads JAX only when asked for: the block store needs numpy alone.
    if name in ("KVCacheManager", "KVCacheStore"):  # upstream TPU Sync's names: its semantics
        upstream_module = "kv_cache_manager" if name == "KVCacheManager" else "kv_cache_store"
        return getattr(importlib.import_module(f"tpusync.upstream.{upstream_module}"), name)
    if name in ("PageMover", "PrefixStore", "TransferStatus"):
        from tpusync import kv_cache

        return getattr(kv_cache, name)
    if name in ("WeightSynchronizer", "WeightSynchronizerManager"):
        from tpusync import weights

        return getattr(weights, name)
    raise AttributeError(f"module 'tpusync' has no attribute {name!r}")
