"""tpusync: move KV-cache blocks and weights between accelerators, host DRAM, disk and hosts."""

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
    "PreconditionError",
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
    if name in ("KVCacheManager", "KVCacheStore", "TransferStatus"):
        from tpusync import kv_cache

        return getattr(kv_cache, name)
    if name in ("WeightSynchronizer", "WeightSynchronizerManager"):
        from tpusync import weights

        return getattr(weights, name)
    raise AttributeError(f"module 'tpusync' has no attribute {name!r}")
