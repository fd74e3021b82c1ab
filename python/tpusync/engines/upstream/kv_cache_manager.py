"""`tpu_raiden.api.jax.kv_cache_manager`: upstream's worker-side KVCacheManager on tpusync.

Upstream's host-pool mode (`host_blocks_to_allocate`), as google/tpu-sync has it from 06-26
(f9e8ed5a) through HEAD (8acb2ef, tpu_sync/api/jax/kv_cache_manager.py): a pool of host
blocks ("chunks") numbered 0..host_blocks_to_allocate-1, each holding one device block (one
page of every layer, per shard), filled by `d2h`/`d2h_auto_allocate` and read back into the
device cache by `h2d`:
- `d2h_auto_allocate(device_blocks)` allocates locked chunks, reclaiming the least recently
  unlocked ones when none is free, and raises when every chunk is locked;
- `unlock_blocks(chunks)` makes chunks reclaimable; they stay readable until reclaimed;
- `h2d(chunks, device_blocks)` / `d2h(device_blocks, chunks)` copy; src first, then dst.

Here the chunks live in the pod's tpusync sidecar (its shared-memory DRAM pool, through
`tpusync.kv.pages`), each under a key of this manager and the chunk's generation, pinned on this
manager's connection while allocated: the pool cannot evict a chunk the scheduler may still
hand out, and a crashed engine's pins go with its connection. The sidecar comes from
$TPUSYNC_CONTROL_SOCKET.

Upstream copies into the device buffers it was given, in place. A JAX program cannot: loads
build new arrays (the old ones donated), so the manager holds the model runner, whose
`kv_caches` it reassigns; upstream's consumers construct the manager in
`register_runner(self, runner)` with `kv_caches=runner.kv_caches`, and the constructor finds
that runner in its caller's frame (checking that `runner.kv_caches` is the list passed in),
or takes it as `runner=`. Copies complete before the call returns (the offload connector drops
h2d's future and expects the next forward to see the pages); the futures returned are done.

Upstream's transfer mode (max_blocks, num_slots: the P/D connector's pulls between engines,
`register_read`, `start_read`, `poll_stats`, `get_local_endpoints`) is tpusync.engines.upstream.pd.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from types import FrameType
from typing import Any

from tpusync import errors
from tpusync.engines.upstream import pd
from tpusync.engines.upstream.counters import count
from tpusync.kv import pages
from tpusync.kv.keys import key_of
from tpusync.store import connect_sidecar

__all__ = ["KVCacheManager"]

_instances = itertools.count()


class CopyFuture:
    """A finished copy, with upstream's future methods (the copy ran in the call that made it)."""

    def Await(self) -> None:  # upstream's name
        return None

    def wait(self) -> None:
        return None

    def IsReady(self) -> bool:  # upstream's name
        return True

    def is_ready(self) -> bool:
        return True


def _caller_runner(kv_caches: list[Any], depth: int) -> Any:
    """The model runner whose `kv_caches` the caller passed in (a local named `runner`)."""
    frame: FrameType | None = sys._getframe(depth)
    for _ in range(3):  # the caller, or a wrapper of it
        if frame is None:
            break
        runner = frame.f_locals.get("runner")
        if runner is not None and getattr(runner, "kv_caches", None) is kv_caches:
            return runner
        frame = frame.f_back
    raise errors.InvalidArgumentError(
        "tpusync.engines.upstream.KVCacheManager needs the model runner that owns kv_caches (JAX arrays cannot be "
        "written in place): pass runner=, or construct it where a local `runner` holds kv_caches, as tpu-inference's "
        "connectors do in register_runner")


def _pairs(src: Sequence[int], dst: Sequence[int], sizes: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """(src blocks, dst blocks), one pair per block copied; raises when they do not pair up."""
    a, b = _expand(src, sizes), _expand(dst, sizes)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} source blocks for {len(b)} destination blocks")
    return a, b


def _expand(offsets: Sequence[int], sizes: Sequence[int] | None) -> list[int]:
    if sizes is None:
        return [int(o) for o in offsets]
    if len(sizes) != len(offsets):
        raise ValueError(f"{len(offsets)} offsets for {len(sizes)} copy sizes")
    return [int(o) + k for o, n in zip(offsets, sizes) for k in range(int(n))]


class KVCacheManager:
    def __init__(self, kv_caches: list[Any], local_control_port: int, max_blocks: int | None = None,
                 num_slots: int | None = None, timeout_s: float = 120.0, unsafe_skip_buffer_lock: bool = True,
                 host_blocks_to_allocate: int | None = None, parallelism: int = 4, node_id: int = 0,
                 raiden_worker_port: int | None = None, raiden_controller_address: str | None = None,
                 worker_id: str | None = None, *, runner: Any = None, control_socket: str | None = None) -> None:
        if host_blocks_to_allocate is None and (max_blocks is None or num_slots is None):
            raise ValueError("Must specify either (max_blocks, num_slots) or host_blocks_to_allocate.")
        if host_blocks_to_allocate is not None and host_blocks_to_allocate <= 0:
            raise ValueError(f"host_blocks_to_allocate must be positive, not {host_blocks_to_allocate}")
        self._runner = runner if runner is not None else _caller_runner(kv_caches, 2)
        if self._runner.kv_caches is not kv_caches and list(self._runner.kv_caches) != list(kv_caches):
            raise errors.InvalidArgumentError("runner.kv_caches is not the kv_caches passed in")
        self._store = connect_sidecar(control_socket)
        nbytes = pages.block_bytes(kv_caches)
        if nbytes > self._store.block_bytes:
            self._store.close()
            raise errors.InvalidArgumentError(f"a block of this cache is {nbytes} bytes per shard, the sidecar's "
                                              f"pool blocks hold {self._store.block_bytes}")
        self._transfers: pd.Transfers | None = None
        if host_blocks_to_allocate is None:
            assert max_blocks is not None and num_slots is not None
            self._transfers = pd.Transfers(self._runner, self._store, lambda: connect_sidecar(control_socket),
                                           max_blocks=max_blocks, num_slots=num_slots, timeout_s=timeout_s)
            self._port = local_control_port
            return
        self._prefix = f"tpusync.engines.upstream.KVCacheManager/{os.getpid()}/{next(_instances)}/{id(self):x}"
        self._lock = threading.Lock()
        self._free = list(range(host_blocks_to_allocate - 1, -1, -1))  # never used yet; pop() takes the lowest
        self._unlocked: OrderedDict[int, None] = OrderedDict()         # readable, reclaimable, oldest first
        self._locked: set[int] = set()
        self._generation: dict[int, int] = {}                          # chunk -> generation of what it holds
        self.host_blocks = host_blocks_to_allocate

    # -- the transfer mode ---------------------------------------------------------------------

    def _pd(self) -> pd.Transfers:
        if self._transfers is None:
            raise RuntimeError("this KVCacheManager was built with host_blocks_to_allocate (the host pool); "
                               "transfers need max_blocks and num_slots")
        return self._transfers

    def register_read(self, req_id: str, uuid: int, block_ids: list[int]) -> bool:
        """Producer: offers the blocks to the consumer that pulls `uuid` (until timeout_s)."""
        return self._pd().register_read(req_id, uuid, block_ids)

    def start_read(self, req_id: str, uuid: int, remote_endpoint: str | list[dict[str, Any]],
                   remote_block_ids: list[int], local_block_ids: list[int], parallelism: int = 1) -> None:
        """Consumer: pulls the producer's blocks `remote_block_ids` into `local_block_ids`;
        the outcome comes from poll_stats."""
        self._pd().start_read(req_id, uuid, remote_endpoint, remote_block_ids, local_block_ids)

    def poll_stats(self) -> tuple[list[str], list[str], list[str]]:
        """(done_sending, done_recving, failed_recving) since the last call."""
        return self._pd().poll_stats()

    def get_local_endpoints(self) -> list[dict[str, Any]]:
        """One endpoint: this pod's sidecar serves every shard of the host."""
        shards = pages.host_shards(self._runner.kv_caches)[0]
        return [{"endpoint": f"{_host_ip()}:{self._port}", "shards": list(range(shards))}]

    # -- the host pool ----------------------------------------------------------------------

    def _need_pool(self) -> None:
        if self._transfers is not None:
            raise RuntimeError("this KVCacheManager was built for transfers (max_blocks, num_slots); the host "
                               "pool needs host_blocks_to_allocate")

    def _key(self, chunk: int) -> int:
        """The pool key of what the chunk holds now (a new generation for each new content)."""
        text = f"{self._prefix}/{chunk}/{self._generation[chunk]}"
        return key_of(hashlib.blake2b(text.encode(), digest_size=32).digest())

    def _stored(self, keys: list[int]) -> list[int]:
        return pages.shard_keys(keys, self._runner.kv_caches)

    def _allocate(self, n: int) -> list[int]:
        """n chunks, locked: free ones first, then the least recently unlocked (their old
        contents dropped). Raises when fewer than n are free or unlocked."""
        with self._lock:
            if n > len(self._free) + len(self._unlocked):
                count(pool_full=1)
                raise RuntimeError(f"RESOURCE_EXHAUSTED: {n} host blocks wanted, {len(self._free)} free and "
                                   f"{len(self._unlocked)} reclaimable of {self.host_blocks} "
                                   f"({len(self._locked)} locked)")
            got, reclaimed = [], []
            for _ in range(n):
                if self._free:
                    got.append(self._free.pop())
                else:
                    chunk, _ = self._unlocked.popitem(last=False)
                    reclaimed.append(self._key(chunk))
                    got.append(chunk)
            for chunk in got:
                self._generation[chunk] = self._generation.get(chunk, -1) + 1
                self._locked.add(chunk)
        if reclaimed:
            self._drop(reclaimed)
            count(reclaimed_blocks=len(reclaimed))
        return got

    def _drop(self, keys: list[int]) -> None:
        """Unpins reclaimed contents and lets the pool evict them. Best effort: nothing reads
        them again, and a restarted sidecar has dropped this connection's pins already."""
        stored = self._stored(keys)
        with contextlib.suppress(errors.TpuSyncError):
            self._store.release(stored)
        with contextlib.suppress(errors.TpuSyncError):
            self._store.evict(stored)

    def _give_back(self, chunks: list[int]) -> None:
        """Chunks whose copy failed: free again, holding nothing."""
        with self._lock:
            for chunk in chunks:
                self._locked.discard(chunk)
                self._generation.pop(chunk, None)
                self._free.append(chunk)

    def _save(self, device_blocks: list[int], chunks: list[int]) -> None:
        keys = [self._key(c) for c in chunks]
        try:
            pages.save_pages(self._store, keys, self._runner.kv_caches, device_blocks)
            self._store.pin(self._stored(keys))
        except (errors.TpuSyncError, OSError) as e:
            self._give_back(chunks)
            count(copy_errors=1)
            raise RuntimeError(f"Async copy failed: saving {len(chunks)} blocks to tpusync's pool: {e}") from e
        count(d2h_blocks=len(chunks))

    # -- upstream's calls ---------------------------------------------------------------------

    def d2h_auto_allocate(self, src_offsets: Sequence[int],
                          copy_sizes: Sequence[int] | None = None) -> tuple[list[int], CopyFuture]:
        """Copies device blocks into newly allocated, locked host blocks: (their ids, in the
        order of the device blocks, a done future). Raises when the pool has no room."""
        self._need_pool()
        blocks = _expand(src_offsets, copy_sizes)
        chunks = self._allocate(len(blocks))
        self._save(blocks, chunks)
        return chunks, CopyFuture()

    def d2h(self, src_offsets: Sequence[int], dst_offsets: Sequence[int],
            copy_sizes: Sequence[int] | None = None) -> CopyFuture:
        """Copies device blocks src into host blocks dst (which then hold them, locked)."""
        self._need_pool()
        blocks, chunks = _pairs(src_offsets, dst_offsets, copy_sizes)
        bad = [c for c in chunks if not 0 <= c < self.host_blocks]
        if bad:
            raise ValueError(f"host blocks {bad} are outside the pool (0..{self.host_blocks - 1})")
        old = []
        with self._lock:
            for c in chunks:
                if c in self._generation:
                    old.append(self._key(c))
                if c in self._free:
                    self._free.remove(c)
                self._unlocked.pop(c, None)
                self._generation[c] = self._generation.get(c, -1) + 1
                self._locked.add(c)
        if old:
            self._drop(old)
        self._save(blocks, chunks)
        return CopyFuture()

    def h2d(self, src_offsets: Sequence[int], dst_offsets: Sequence[int],
            copy_sizes: Sequence[int] | None = None) -> CopyFuture:
        """Copies host blocks src into device blocks dst of the runner's cache, before returning."""
        self._need_pool()
        chunks, blocks = _pairs(src_offsets, dst_offsets, copy_sizes)
        with self._lock:
            empty = [c for c in chunks if c not in self._generation]
            keys = [self._key(c) for c in chunks if c in self._generation]
        if empty:
            raise RuntimeError(f"host blocks {empty} hold nothing (never copied to, or reclaimed)")
        self._runner.kv_caches, loaded = pages.load_pages(self._store, keys, self._runner.kv_caches, blocks)
        count(h2d_blocks=loaded)
        if loaded < len(keys):
            count(copy_errors=1)
            raise RuntimeError(f"Async copy failed: tpusync's pool lost host block {chunks[loaded]} "
                               f"({loaded} of {len(keys)} copied)")
        return CopyFuture()

    def unlock_blocks(self, block_ids: Sequence[int]) -> None:
        """Makes host blocks reclaimable (most recently unlocked last); unknown ids are ignored."""
        self._need_pool()
        with self._lock:
            for c in block_ids:
                if c in self._locked:
                    self._locked.discard(c)
                    self._unlocked[c] = None

    def close(self) -> None:
        if self._transfers is not None:
            self._transfers.close()
        self._store.close()


def _host_ip() -> str:
    """The address peers reach this pod at: $VLLM_HOST_IP, as tpu-inference advertises it."""
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
