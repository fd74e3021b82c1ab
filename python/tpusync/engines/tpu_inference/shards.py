"""The scheduler half's view of the store when the KV cache is sharded (tensor parallelism).

tpu-inference shards every layer of the KV cache on the mesh's `model` axis, and the worker
half stores each shard's part of a block under its own key (`tpusync.kv.pages.shard_key`). The
scheduler half (`tpusync.engines.connector.scheduler.SchedulerSide`) thinks in block keys; `ShardedStore`
lets it: a block is present when every shard of it is, a lookup pins and a release unpins
every shard, a pull fetches every shard, and a block's tier is where all its shards are.
Shard keys go to the store interleaved, block after block (`[b0s0, b0s1, b1s0, ...]`), so
the store's prefix semantics (lookups, prefix-aware pulls) hold block by block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tpusync import errors
from tpusync.engines.connector.config import ConnectorConfig
from tpusync.engines.connector.link import StoreLink
from tpusync.kv.events import block_tier
from tpusync.kv.keys import shard_key
from tpusync.store import Changes, KVStore, LookupResult


class ShardedStore:
    """A KVStore seen through block keys, for blocks stored as `shards` parts."""

    def __init__(self, store: KVStore, shards: int) -> None:
        self.store, self.shards = store, shards

    def _keys(self, keys: Sequence[int]) -> list[int]:
        return [shard_key(k, n, self.shards) for k in keys for n in range(self.shards)]

    @property
    def block_bytes(self) -> int:
        return self.store.block_bytes

    def lookup(self, keys: Sequence[int], *, pin: bool = False) -> LookupResult:
        sk = self._keys(keys)
        found = self.store.lookup(sk, pin=pin)
        blocks, partial = divmod(found.prefix_len, self.shards)
        if pin and partial:  # shards of a block past the whole ones: not offered, so not pinned
            self.store.release(sk[blocks * self.shards:found.prefix_len])
        return LookupResult(blocks, self._by_block(found.tiers, len(keys)))

    def _by_block(self, shard_tiers: np.ndarray, n: int) -> np.ndarray:
        tiers = np.asarray(shard_tiers, np.uint8).reshape(n, self.shards).tolist()
        return np.array([block_tier(shards) for shards in tiers], np.uint8)

    def where(self, keys: Sequence[int]) -> np.ndarray:
        """KVStore.where by block, as lookup combines its shards' tiers."""
        return self._by_block(self.store.where(self._keys(keys)), len(keys))

    def changes(self, cursor: tuple[int, int] = (0, 0), *, wait_s: float = 0.0, max_keys: int = 65536) -> Changes:
        """KVStore.changes by block: each changed shard names every block it may be a part of
        (a shard's key is its block's key xor the shard's constant, so shard_key undoes it), for
        an announcer that keeps the blocks it knows (BlockAnnouncer.audit)."""
        got = self.store.changes(cursor, wait_s=wait_s, max_keys=max_keys)
        blocks = [shard_key(k, n, self.shards) for k in got.keys for n in range(self.shards)]
        return Changes(got.cursor, got.lost, blocks)

    def release(self, keys: Sequence[int], *, for_host: bool = False) -> None:
        self.store.release(self._keys(keys), for_host=for_host)

    def evict(self, keys: Sequence[int]) -> None:
        sk = self._keys(keys)
        present = [k for k, tier in zip(sk, self.store.lookup(sk).tiers) if tier]
        if present:
            self.store.evict(present)

    def read_parts(self, peer: str, keys: Sequence[int], parts: Sequence[int]) -> None:
        """Pulls only shards `parts` of each block (a multi-host prefill's host holds only those)."""
        self.store.read_remote(peer, [shard_key(k, n, self.shards) for k in keys for n in parts])

    def read_remote(self, peer: str, keys: Sequence[int]) -> list[bool]:
        held = self.store.read_remote(peer, self._keys(keys))
        return [all(held[i * self.shards:(i + 1) * self.shards]) for i in range(len(keys))]

    def close(self) -> None:
        self.store.close()


class ShardedStoreLink(StoreLink):
    """A StoreLink whose store is seen through block keys (`ShardedStore`)."""

    def __init__(self, cfg: ConnectorConfig, shard_bytes: int, purpose: str, shards: int) -> None:
        super().__init__(cfg, shard_bytes, purpose)
        self._shards = shards

    def _open(self) -> Any:
        return ShardedStore(super()._open(), self._shards)

    reshards = True

    def view(self, store: Any, shards: int) -> Any:
        return ShardedStore(store.store, shards) if shards else store

    def _close(self, store: Any) -> None:
        super()._close(store.store if isinstance(store, ShardedStore) else store)


class SliceView(ShardedStore):
    """The blocks of a multi-host slice, seen from one host's sidecar (the scheduler's, on the
    leader's pod): each host holds its own shards of every block in its own sidecar, so where a
    block is takes this sidecar's answer for its own shards and each other host's sidecar's for
    theirs (asked through this one, `where_remote`); a block is where all its parts are
    (`block_tier`), and nowhere until every host has said which shards it holds. No pins: the
    hosts take those themselves (tpusync.engines.tpu_inference.worker.SliceHost). Its change feed is this
    sidecar's: what another host's sidecar drops is found by the next audit. Evictions are of
    this sidecar's parts (another host's are that host's to drop)."""

    def __init__(self, store: KVStore, shards: int, slice_hosts: Callable[[], dict[int, tuple[str | None, list[int]]]],
                 hosts: int, own_address: str | None) -> None:
        super().__init__(store, shards)
        self._slice_hosts, self._hosts, self._own = slice_hosts, hosts, own_address

    def where(self, keys: Sequence[int]) -> np.ndarray:
        known = dict(self._slice_hosts())
        if len(known) < self._hosts or not keys:
            return np.zeros(len(keys), np.uint8)
        local = self._own if any(a == self._own for a, _ in known.values()) else known[min(known)][0]
        parts: list[list[int]] = [[] for _ in keys]
        for address, numbers in known.values():
            wanted = [shard_key(k, n, self.shards) for k in keys for n in numbers]
            if address == local:
                found = self.store.where(wanted)
            elif address is None:  # a host that cannot be asked holds nothing anyone can load
                found = np.zeros(len(wanted), np.uint8)
            else:
                found = self.store.where_remote(address, wanted)
            tiers = np.asarray(found, np.uint8).reshape(len(keys), len(numbers)).tolist()
            for i, t in enumerate(tiers):
                parts[i] += t
        return np.array([block_tier(p) for p in parts], np.uint8)

    def lookup(self, keys: Sequence[int], *, pin: bool = False) -> LookupResult:
        if pin:
            raise errors.InvalidArgumentError("a slice's hosts pin their own parts")
        tiers = self.where(keys)
        return LookupResult(next((i for i, t in enumerate(tiers) if not t), len(tiers)), tiers)


class SliceStoreLink(ShardedStoreLink):
    """A StoreLink whose store is seen as the slice's blocks (`SliceView`)."""

    def __init__(self, cfg: ConnectorConfig, shard_bytes: int, purpose: str, shards: int,
                 slice_hosts: Callable[[], dict[int, tuple[str | None, list[int]]]], hosts: int) -> None:
        super().__init__(cfg, shard_bytes, purpose, shards)
        self._slice_hosts, self._hosts, self._own = slice_hosts, hosts, cfg.data_address

    def _open(self) -> Any:
        return SliceView(super()._open().store, self._shards, self._slice_hosts, self._hosts, self._own)


def shard_links(sched: Any, cfg: ConnectorConfig, shard_bytes: int, shards: int) -> None:
    """Points a SchedulerSide's store links (lookups, pulls, KV-event audits and feed) at the shards
    the workers store, and lets its lookups and pulls see blocks another engine split otherwise.
    On a multi-host slice, the links of its KV events and announcements see the slice's blocks
    (`SliceView`). Nothing is opened yet when this runs: the links open on first use."""
    def link(purpose: str) -> ShardedStoreLink:
        if sched.hosts > 1:
            return SliceStoreLink(cfg, shard_bytes, purpose, shards, lambda: sched.slice, sched.hosts)
        return ShardedStoreLink(cfg, shard_bytes, purpose, shards)

    sched.link = link("lookups")
    sched.pull_link = ShardedStoreLink(cfg, shard_bytes, "peer pulls", shards)
    if sched.events is not None and shards > 1:  # unsplit blocks are announced as they are
        sched.events.sharded(link("KV event audits"), link("the KV events feed"))


def check_shards(total: int, expected: int) -> None:
    """The worker's cache must be split as the scheduler half keys it."""
    if total != expected:
        raise errors.InvalidArgumentError(
            f"the KV cache has {total} shards per layer, the scheduler keys blocks in {expected} "
            "(tensor_parallel_size)")
