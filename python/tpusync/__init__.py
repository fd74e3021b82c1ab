"""tpusync: move KV-cache blocks and weights between accelerators, host DRAM, disk and hosts."""

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
    "KVStore",
    "LookupResult",
    "NotFoundError",
    "PreconditionError",
    "StorageIOError",
    "Tier",
    "TpuSyncError",
    "errors",
]
__version__ = "0.1.0"
