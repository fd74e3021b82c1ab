"""`tpu_raiden.api.jax.kv_cache_store`: upstream's scheduler-side block directory.

The API and semantics of upstream google/tpu-sync at 1cd9ad1f (2026-07-23, then still
tpu_raiden/api/jax/kv_cache_store.py over tpu_raiden/kv_cache/kv_cache_store.cc and
lru_cache.h), the version tpu-inference 0.32.0's RaidenOffloadConnector was written against
(tpu-inference #3238, the same day): built with `capacity` alone, the store is an in-memory LRU
directory from block hash to where the block is (a RaidenBlockID naming a host chunk), with
pin counts. The worker's KVCacheManager holds the bytes; this object only remembers them.

Kept as upstream has them, consumers depend on each:
- `lookup` walks the hashes in order up to `capacity - pinned` and stops at the first miss,
  without pinning or refreshing the LRU order;
- `pin` is all-or-nothing (False, nothing pinned, if a hash is absent) and counts;
- `release` drops one pin per hash, silently for unknown or unpinned hashes;
- `insert` adds each absent hash at the MRU end, evicting the LRU unpinned entry when full,
  and returns (all inserted, [(evicted hash, its RaidenBlockID)]); a present hash makes
  `all_inserted` False. When every entry is pinned nothing is inserted or evicted and
  `all_inserted` stays True (upstream's LruCache::Put quirk).
The controller-backed modes (num_shards > 0, a registry or controller address) and the data
calls they serve (save, load, read_remote) are not provided: the constructor refuses them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tpusync.engines.upstream.common import BlockStatus

__all__ = ["BlockStatus", "KVCacheStore", "RaidenBlockID", "RaidenId"]


class RaidenId:
    """Names a piece of data: (job, job replica, data name, data replica index). For the offload
    connector the data replica index is the host chunk id."""

    def __init__(self, job_name: str = "", job_replica_id: str = "", data_name: str = "", data_replica_idx: int = 0,
                 impl: Any = None) -> None:
        self._fields = (str(job_name), str(job_replica_id), str(data_name), int(data_replica_idx))

    job_name = property(lambda self: self._fields[0])
    job_replica_id = property(lambda self: self._fields[1])
    data_name = property(lambda self: self._fields[2])
    data_replica_idx = property(lambda self: self._fields[3])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RaidenId) and self._fields == other._fields

    __hash__ = None  # type: ignore[assignment]  # upstream's are unhashable too

    def __repr__(self) -> str:
        job, replica, data, idx = self._fields
        return f"RaidenId(job='{job}', replica='{replica}', data='{data}', data_idx={idx})"


class RaidenBlockID:
    """A block's location: its RaidenId, host and device block ids, and status."""

    def __init__(self, raiden_id: RaidenId | None = None, host_block_id: int = -1,
                 status: BlockStatus = BlockStatus.INIT, device_block_id: int = -1, impl: Any = None) -> None:
        self.raiden_id = raiden_id if raiden_id is not None else RaidenId()
        self.host_block_id = host_block_id
        self.status = status
        self.device_block_id = device_block_id

    job_name = property(lambda self: self.raiden_id.job_name)
    job_replica_id = property(lambda self: self.raiden_id.job_replica_id)
    data_name = property(lambda self: self.raiden_id.data_name)
    data_replica_idx = property(lambda self: self.raiden_id.data_replica_idx)

    def __repr__(self) -> str:
        return (f"RaidenBlockID({self.raiden_id!r}, host_block_id={self.host_block_id}, "
                f"status={self.status.name}, device_block_id={self.device_block_id})")


class KVCacheStore:
    def __init__(self, capacity: int, global_registry_address: str = "", raiden_id: RaidenId | None = None,
                 num_shards: int = 0, shard_size_bytes: int = 0, raiden_orchestrator_address: str = "",
                 raiden_controller_address: str = "") -> None:
        if num_shards or global_registry_address or raiden_orchestrator_address or raiden_controller_address:
            raise NotImplementedError(
                "tpusync.engines.upstream's KVCacheStore is upstream's in-memory directory (capacity alone); the "
                "controller-backed store (num_shards, registry or controller addresses) is not provided: "
                "use tpusync's KVStore/KVCacheStore, which every pod's sidecar serves")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, not {capacity}")
        self._capacity = int(capacity)
        self._raiden_id = raiden_id if raiden_id is not None else RaidenId()
        self._lru: OrderedDict[bytes, RaidenBlockID] = OrderedDict()  # unpinned, least recent first
        self._pinned: dict[bytes, tuple[RaidenBlockID, int]] = {}     # hash -> (entry, pin count)

    @property
    def raiden_id(self) -> RaidenId:
        return self._raiden_id

    @property
    def raiden_controller_address(self) -> str:
        return ""

    def capacity(self) -> int:
        return self._capacity

    def _get(self, h: bytes) -> RaidenBlockID | None:
        if h in self._pinned:
            return self._pinned[h][0]
        return self._lru.get(h)

    def lookup(self, block_hashes: Sequence[bytes], enable_global: bool = False) -> list[tuple[bytes, RaidenBlockID]]:
        """The leading hashes held, with where each is (no registry: `enable_global` finds nothing more)."""
        found = []
        for h in list(block_hashes)[:max(0, self._capacity - len(self._pinned))]:
            entry = self._get(bytes(h))
            if entry is None:
                break
            found.append((bytes(h), entry))
        return found

    def insert(self, block_hashes: Sequence[bytes], slices: Sequence[RaidenId | RaidenBlockID],
               on_host: bool) -> tuple[bool, list[tuple[bytes, RaidenBlockID]]]:
        all_inserted, evicted = True, []
        for i, raw in enumerate(block_hashes):
            h = bytes(raw)
            if self._get(h) is not None:
                all_inserted = False
                continue
            s = slices[i] if i < len(slices) else RaidenBlockID()
            entry = s if isinstance(s, RaidenBlockID) else RaidenBlockID(raiden_id=s)
            if len(self._lru) + len(self._pinned) >= self._capacity:
                if not self._lru:
                    continue  # everything is pinned: neither inserted nor evicted (upstream's quirk)
                evicted.append(self._lru.popitem(last=False))
            self._lru[h] = entry
        return all_inserted, evicted

    def insert_and_lock(self, block_hashes: Sequence[bytes], slices: Sequence[RaidenId | RaidenBlockID],
                        on_host: bool) -> bool:
        inserted, _ = self.insert(block_hashes, slices, on_host)
        return self.pin(block_hashes) and inserted

    def pin(self, block_hashes: Sequence[bytes]) -> bool:
        hashes = [bytes(h) for h in block_hashes]
        if any(self._get(h) is None for h in hashes):
            return False
        for h in hashes:
            if h in self._pinned:
                entry, count = self._pinned[h]
                self._pinned[h] = (entry, count + 1)
            else:
                self._pinned[h] = (self._lru.pop(h), 1)
        return True

    def release(self, block_hashes: Sequence[bytes]) -> None:
        for raw in reversed(list(block_hashes)):
            h = bytes(raw)
            if h not in self._pinned:
                continue
            entry, count = self._pinned[h]
            if count > 1:
                self._pinned[h] = (entry, count - 1)
            else:
                del self._pinned[h]
                self._lru[h] = entry  # back at the most recent end

    def release_and_delete(self, block_hashes: Sequence[bytes]) -> int:
        """Drops one pin per hash and deletes the entries left unpinned; how many were deleted."""
        self.release(block_hashes)
        deleted = 0
        for raw in block_hashes:
            if self._lru.pop(bytes(raw), None) is not None:
                deleted += 1
        return deleted

    def delete(self, block_hashes: Sequence[bytes], slices: Sequence[Any] = ()) -> None:
        for raw in block_hashes:
            self._lru.pop(bytes(raw), None)
            self._pinned.pop(bytes(raw), None)

    # The data calls need upstream's controller, which this directory has not (num_shards == 0):
    # upstream answers them with failure too.
    def save(self, block_hashes: Sequence[bytes]) -> bool:
        return False

    def load(self, block_hashes: Sequence[bytes], device_block_ids: Sequence[int]) -> bool:
        return False

    def read_remote(self, block_hashes: Sequence[bytes]) -> bool:
        return False

    def poll_save_status(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        return [], [], []

    def poll_load_status(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        return [], [], []

    def poll_remote_read_status(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        return [], [], []
