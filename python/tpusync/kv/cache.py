"""PrefixStore and PageMover: tpusync's own engine-facing KV-cache API over tpusync stores.

Upstream TPU Sync's KVCacheStore and KVCacheManager (the names `tpusync.KVCacheStore` and
`tpusync.KVCacheManager` stand for) are tpusync.engines.upstream's, with upstream's signatures; these
two are tpusync's, keyed by 128-bit block hashes (docs/migrating.md compares them).

Who calls what:
- A serving engine's scheduler calls `PrefixStore.lookup(hashes, pin_found=True)` when a
  request arrives, to learn how much of its prefix is cached; pins keep those blocks until a
  `load` consumes them (or `release` drops them).
- Its worker calls `PageMover.h2d` / `d2h` to move pages between the device KV cache and
  the host pool, and `register_read` + `start_read` to fetch blocks from a peer for a request;
  `poll_stats` reports finished requests each step.
Nothing here blocks the caller: every transfer runs on a worker thread and returns a handle
(a `concurrent.futures.Future`) or is reported by a poll.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from tpusync import errors
from tpusync.kv.pages import KV_PAGE_AXIS, load_pages, save_pages
from tpusync.store import KVStore

log = logging.getLogger(__name__)


class TransferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


def _status(handle: Future[Any]) -> TransferStatus:
    if not handle.done():
        return TransferStatus.PENDING
    return TransferStatus.FAILED if handle.exception() is not None else TransferStatus.DONE


class PrefixStore:
    """Host KV-cache blocks by hash: lookup with pins, save/load with polled status, remote reads."""

    def __init__(self, store: KVStore, *, workers: int = 2) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tpusync-kvstore")
        self._pins: dict[int, int] = {}  # pins this object holds, by key
        self._lock = threading.Lock()

    def lookup(self, hashes: Sequence[int], pin_found: bool = False) -> int:
        """How many leading blocks are cached (any tier). With pin_found they stay until consumed."""
        n = self.store.lookup(hashes, pin=pin_found).prefix_len
        if pin_found:
            with self._lock:
                for h in hashes[:n]:
                    self._pins[h] = self._pins.get(h, 0) + 1
        return n

    def insert(self, hashes: Sequence[int], blocks: Sequence[object]) -> None:
        """Stores host buffers under their hashes now (blocking; see save for the async form)."""
        self.store.put(hashes, blocks)

    def save(self, hashes: Sequence[int], src: Sequence[object] | None, dst: str | None = None) -> Future[None]:
        """Stores host buffers under their hashes (src), then, with dst="host:port", pushes the
        blocks to that peer sidecar (src=None pushes blocks stored earlier)."""
        hashes = list(hashes)
        return self._pool.submit(self._save, hashes, src, dst)

    def _save(self, hashes: list[int], src: Sequence[object] | None, dst: str | None) -> None:
        if src is not None:
            self.store.put(hashes, src)
        if dst is not None:
            stored = self.store.push_remote(dst, hashes)
            if not all(stored):
                raise errors.UnavailableError(f"{dst} stored {sum(stored)} of {len(stored)} blocks")
        self._consume(hashes)

    def load(self, hashes: Sequence[int], dst: Sequence[object]) -> Future[None]:
        """Copies blocks into host buffers; the handle fails if any block is missing."""
        hashes = list(hashes)

        def run() -> None:
            found = self.store.get(hashes, dst)
            if not all(found):
                raise errors.NotFoundError(f"{found.count(False)} of {len(found)} blocks are not cached")
            self._consume(hashes)

        return self._pool.submit(run)

    def read_remote(self, peer: str, hashes: Sequence[int]) -> Future[list[bool]]:
        """Pulls the blocks this host lacks from a peer; the handle's result is the per-block flags."""
        hashes = list(hashes)

        def run() -> list[bool]:
            held = self.store.read_remote(peer, hashes)
            if not all(held):
                raise errors.UnavailableError(f"{peer} delivered {sum(held)} of {len(held)} blocks")
            return held

        return self._pool.submit(run)

    poll_save_status = staticmethod(_status)
    poll_load_status = staticmethod(_status)
    poll_remote_read_status = staticmethod(_status)

    def release(self, hashes: Sequence[int]) -> None:
        """Drops the pins this store took on the hashes (by lookup(pin_found=True))."""
        self._consume(list(hashes))

    def _consume(self, hashes: list[int]) -> None:
        with self._lock:
            mine = [h for h in hashes if self._pins.get(h)]
            for h in mine:
                self._pins[h] -= 1
                if not self._pins[h]:
                    del self._pins[h]
        if mine:
            self.store.release(mine)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class _Read:
    peer: str
    hashes: list[int]
    block_ids: list[int]
    future: Future[None] | None = None


@dataclass
class Stats:
    done_sending: set[str] = field(default_factory=set)
    done_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class PageMover:
    """Moves pages of a device KV cache (k, v: [layers, pages, page_size, kv_heads, head_dim])
    between the device and the host pool, and pulls blocks from peers for requests.

    The manager holds the cache arrays (`k`, `v`); loads replace them, so read them back after
    a request shows up in `poll_stats().done_recving`.
    """

    def __init__(self, store: KVStore, k: jax.Array, v: jax.Array, *, workers: int = 2) -> None:
        self.store = store
        self.k, self.v = k, v
        self._cache_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tpusync-kvmanager")
        self._reads: dict[str, _Read] = {}
        self._stats = Stats()
        self._stats_lock = threading.Lock()
        self._locked: dict[int, int] = {}

    # -- device <-> host ----------------------------------------------------------------------

    def d2h(self, block_ids: Sequence[int], hashes: Sequence[int], *, request_id: str | None = None) -> Future[int]:
        """Saves device pages to the host pool under their hashes (already stored ones are skipped)."""
        block_ids, hashes = list(block_ids), list(hashes)

        def run() -> int:
            # Under the lock: a concurrent h2d donates the arrays, and on the CPU backend the
            # save reads their buffers in place.
            with self._cache_lock:
                written = save_pages(self.store, hashes, [self.k, self.v], block_ids, page_axis=KV_PAGE_AXIS)
            if request_id is not None:
                with self._stats_lock:
                    self._stats.done_sending.add(request_id)
            return written

        return self._pool.submit(run)

    def d2h_auto_allocate(self, block_ids: Sequence[int], hashes: Sequence[int], *,
                          request_id: str | None = None) -> Future[int]:
        """d2h that evicts cold host blocks as needed instead of failing when the pool is full."""
        return self.d2h(block_ids, hashes, request_id=request_id)  # the store's LRU always makes room

    def h2d(self, block_ids: Sequence[int], hashes: Sequence[int], *, request_id: str | None = None) -> Future[int]:
        """Loads host blocks into device pages; the handle's result is the count of leading pages loaded."""
        block_ids, hashes = list(block_ids), list(hashes)
        return self._pool.submit(self._h2d, block_ids, hashes, request_id)

    def _h2d(self, block_ids: list[int], hashes: list[int], request_id: str | None) -> int:
        with self._cache_lock:
            (self.k, self.v), loaded = load_pages(self.store, hashes, [self.k, self.v], block_ids,
                                                  page_axis=KV_PAGE_AXIS)
        if request_id is not None:
            with self._stats_lock:
                (self._stats.done_recving if loaded == len(hashes) else self._stats.failed_recving).add(request_id)
        return loaded

    # -- remote reads for requests -----------------------------------------------------------

    def register_read(self, request_id: str, peer: str, hashes: Sequence[int], block_ids: Sequence[int]) -> None:
        """Declares that `request_id` needs `hashes` from `peer` in device pages `block_ids`."""
        if len(hashes) != len(block_ids):
            raise errors.InvalidArgumentError(f"{len(hashes)} hashes for {len(block_ids)} blocks")
        self._reads[request_id] = _Read(peer, list(hashes), list(block_ids))

    def start_read(self, request_id: str) -> Future[None]:
        """Starts a registered read: pull what the host lacks, then load it into the device pages.
        The request shows up in poll_stats() when done; the handle completes then too."""
        read = self._reads.get(request_id)
        if read is None:
            raise errors.NotFoundError(f"no read registered for request {request_id!r}")

        def run() -> None:
            try:
                held = self.store.read_remote(read.peer, read.hashes)
                n = next((i for i, h in enumerate(held) if not h), len(held))
                loaded = self._h2d(read.block_ids[:n], read.hashes[:n], None)
                ok = n == len(read.hashes) and loaded == n
            except errors.TpuSyncError:
                ok = False
            except Exception:  # reported as a failed read, never a request that vanishes
                log.exception("read for request %s failed", request_id)
                ok = False
            with self._stats_lock:
                (self._stats.done_recving if ok else self._stats.failed_recving).add(request_id)
            self._reads.pop(request_id, None)

        read.future = self._pool.submit(run)
        return read.future

    def poll_stats(self) -> tuple[set[str], set[str], set[str]]:
        """(done_sending, done_recving, failed_recving) since the last poll."""
        with self._stats_lock:
            s, self._stats = self._stats, Stats()
        return s.done_sending, s.done_recving, s.failed_recving

    # -- pins ------------------------------------------------------------------------------------

    def lock_blocks(self, hashes: Sequence[int]) -> None:
        """Pins host blocks so eviction leaves them until unlock_blocks."""
        self.store.pin(list(hashes))
        for h in hashes:
            self._locked[h] = self._locked.get(h, 0) + 1

    def unlock_blocks(self, hashes: Sequence[int]) -> None:
        """Releases pins taken by lock_blocks; unknown hashes are ignored."""
        mine = [h for h in hashes if self._locked.get(h)]
        for h in mine:
            self._locked[h] -= 1
        if mine:
            self.store.release(mine)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def host_blocks(n: int, block_bytes: int) -> list[np.ndarray]:
    """Page-aligned host buffers for `n` blocks (for PrefixStore.load)."""
    return [np.empty(block_bytes, np.uint8) for _ in range(n)]
