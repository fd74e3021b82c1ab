"""KVStore: the block store API that every tpusync backend offers.

`KVStore.local(...)` runs the native engine in this process: a shared-memory DRAM pool
(which survives a restart of this process) in front of an optional disk tier. It is the
embedded default used by the tests and the demo, with no sidecar.
"""

from __future__ import annotations

import enum
import os
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from tpusync import _native, errors

Keys = Any  # Sequence[int | bytes] or a numpy uint64 array of shape (n, 2)


class Tier(enum.IntEnum):
    """Where a block lives; LookupResult.tiers holds these codes as uint8."""

    NONE = 0
    DRAM = 1
    DISK = 2
    DRAM_AND_DISK = 3


class LookupResult(NamedTuple):
    prefix_len: int
    """How many leading keys are present in some tier."""
    tiers: np.ndarray
    """Per key, a Tier code (uint8): NONE, DRAM, DISK or DRAM_AND_DISK."""


class KVStore:
    """A content-addressed store of fixed-size blocks keyed by 128-bit hashes.

    Thread-safe. Calls that copy or touch the disk release the GIL. Keys are ints in
    [0, 2**128), 16-byte big-endian bytes, or a uint64 array of shape (n, 2) [hi, lo].
    Buffers are any objects with the buffer protocol (numpy arrays, bytearrays, memoryviews,
    CPU jax arrays through ``np.asarray``); nothing is copied on the way to the engine.
    """

    def __init__(self, native: _native.Store):
        self._native = native

    @classmethod
    def local(
        cls,
        *,
        dram_bytes: int,
        block_bytes: int,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 0,
        pool_path: str | os.PathLike[str] | None = None,
        hugepages: bool = False,
        mlock: bool = False,
        io_threads: int = 1,
    ) -> KVStore:
        """Opens an in-process store.

        With ``pool_path`` the DRAM pool lives in that shared-memory file and survives the
        process: opening the same path again finds every committed block. Without it a
        private file under /dev/shm is used and removed on close. ``disk_dir`` adds a disk
        tier of ``disk_bytes`` that evicted blocks are written behind to.
        """
        if block_bytes <= 0 or dram_bytes < block_bytes:
            raise errors.InvalidArgumentError(
                f"dram_bytes ({dram_bytes}) must hold at least one block of block_bytes ({block_bytes})")
        if disk_dir is not None and disk_bytes < block_bytes:
            raise errors.InvalidArgumentError(
                f"disk_bytes ({disk_bytes}) must hold at least one block of block_bytes ({block_bytes})")
        private = pool_path is None
        path = os.fspath(pool_path) if pool_path else f"/dev/shm/tpusync-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        native = _native.Store(
            path,
            block_bytes=block_bytes,
            num_slots=dram_bytes // block_bytes,
            disk_dir=os.fspath(disk_dir) if disk_dir is not None else None,
            disk_bytes=disk_bytes,
            hugepages=hugepages,
            mlock=mlock,
            unlink_on_close=private,
            io_threads=io_threads,
        )
        return cls(native)

    # -- blocks ---------------------------------------------------------------------------

    def put(self, keys: Keys, buffers: Sequence[Any]) -> None:
        """Stores each buffer (1..block_bytes bytes) under its key. Present keys are skipped.

        Raises CapacityError when DRAM is full of pinned blocks; blocks stored before that
        stay stored.
        """
        self._native.put(keys, buffers)

    def get(self, keys: Keys, buffers: Sequence[Any]) -> list[bool]:
        """Copies each present block into its writable buffer; returns which were found.

        A disk block that fails its checksum is reported in stats() and counted as a miss.
        """
        return self._native.get(keys, buffers)

    def lookup(self, keys: Keys, *, pin: bool = False) -> LookupResult:
        """Returns the present prefix length and per-key tiers; pins the prefix if asked."""
        prefix_len, tiers = self._native.lookup(keys, pin=pin)
        return LookupResult(prefix_len, tiers)

    def pin(self, keys: Keys) -> None:
        """Keeps blocks from eviction until released. NotFoundError if any key is absent."""
        self._native.pin(keys)

    def release(self, keys: Keys) -> None:
        """Drops one pin per key. PreconditionError if any key is not pinned."""
        self._native.release(keys)

    def evict(self, keys: Keys) -> None:
        """Moves blocks one tier down now: DRAM to disk (or out without a disk tier), disk out."""
        self._native.evict(keys)

    def flush(self) -> None:
        """Waits for write-behind to disk; raises the first demotion error since the last flush."""
        self._native.flush()

    def stats(self) -> dict[str, Any]:
        """Occupancy, hit and eviction counters, integrity and I/O error counts."""
        return self._native.stats()

    # -- zero-copy ------------------------------------------------------------------------

    def reserve(self, key: int | bytes) -> _native.WriteLease:
        """Reserves a DRAM slot to write in place (``memoryview(lease)``), then ``lease.commit(n)``."""
        return self._native.reserve(key)

    def acquire(self, key: int | bytes) -> _native.ReadLease:
        """Holds a block in DRAM and exposes it read-only in place; drop the lease to release."""
        return self._native.acquire(key)

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self._native.block_bytes

    @property
    def pool_path(self) -> str:
        return self._native.pool_path

    def close(self) -> None:
        """Unmaps the pool. A store opened with pool_path keeps its blocks for the next open."""
        self._native.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

