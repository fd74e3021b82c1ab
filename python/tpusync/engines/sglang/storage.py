"""TPUSyncHiCacheStorage: an SGLang HiCache L3 storage backend over a tpusync KVStore.

SGLang 0.5.23 builds it with its dynamic factory (sglang/srt/mem_cache/storage/backend_factory.py,
StorageBackendFactory._create_dynamic_backend: ``backend_class(storage_config, kwargs)``, kwargs
``{}``), hands it the host pool with ``register_mem_pool_host`` (sglang/srt/managers/
cache_controller.py, attach_storage_backend), and with ``"interface_v1": 1`` in the extra config
calls the zero-copy methods (same file: ``_page_get_zero_copy`` -> ``batch_get_v1``,
``_page_set_zero_copy`` -> ``all(batch_set_v1(...))``, ``_storage_hit_query`` ->
``batch_exists``); without it the generic ``batch_get``/``batch_set`` over flat pages.

The extra config (``--hicache-storage-backend-extra-config``, JSON; parsed by
`tpusync.engines.sglang.options`, a malformed option failing the build with its name) also says which store:

    control_socket   the pod's sidecar (default: $TPUSYNC_CONTROL_SOCKET), a path or unix:// URL
    store_url        a sidecar's data port instead, tpusync://host:port, with secret_file
    local            {"dram_bytes": .., "block_bytes": .., "pool_path": ..}: an in-process store
    peers            ["host:port", ...]: data ports to pull missing pages from (through this
                     host's sidecar, on batch_exists)
    model            the model part of the keys (default: SGLang's model_name)
    reconnect_interval_s   how often a lost sidecar is dialled again (default 1.0)
    kv_events        {"endpoint": .., "engine_endpoint": .., "topic": ..}: announce the pages the
                     sidecar holds to llm-d, relayed with SGLang's own events on `endpoint`
                     (tpusync.engines.sglang.events; needs the sidecar)

Copies: the v1 path copies each byte once, between the host pool's page buffers (the
pointers of ``get_page_buffer_meta``) and the store's shared-memory DRAM pool: a page whose parts
are contiguous (page_first, page_first_direct, page_head, MLA page_first) goes through one
batched ``KVStore.put``/``get`` of buffers made on those pointers; a layer_first page's part is
gathered from its per-layer buffers straight into a reserved pool slot (``reserve_many``) and
scattered back from an acquired one (``acquire_many``). Over a data port (no pool here) a
gathered part is staged in one buffer first. Nothing raises into SGLang's cache controller: a
store error is a miss (False, 0, None), logged once per kind and counted.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from tpusync import errors
from tpusync.engines.sglang.events import EventsConfig, StorageEvents, part_keys, publishes
from tpusync.engines.sglang.keys import KeyScope, block_keys
from tpusync.engines.sglang.options import StorageOptions
from tpusync.engines.sglang.plan import Chunk, PagePlan
from tpusync.store import KVStore, connect_sidecar

logger = logging.getLogger(__name__)

_GATHER_GROUP = 64  # reserved or acquired slots held at once on the gather path (they cannot be evicted)
_LOST = (errors.UnavailableError, errors.DeadlineExceededError, ConnectionError, BrokenPipeError)


@functools.lru_cache(maxsize=64)
def _array_type(nbytes: int) -> Any:
    return ctypes.c_ubyte * nbytes


def _buffer_at(address: int, nbytes: int) -> Any:
    """A writable buffer-protocol object over raw memory: no copy."""
    return _array_type(nbytes).from_address(address)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _copy_segments(contiguous: int, ranges: list[tuple[int, int]], *, gather: bool) -> None:
    """Copies between one contiguous run of memory and `ranges` (address, length) laid end to end
    in it: gathers them into it, or scatters it back. Ranges of one length at a constant stride
    (a layer_first part: one range per layer) go in one strided numpy copy; others one by one."""
    n = len(ranges)
    length = ranges[0][1]
    stride = ranges[1][0] - ranges[0][0] if n > 1 else 0
    if n > 2 and stride > 0 and all(r[1] == length and r[0] == ranges[0][0] + i * stride
                                    for i, r in enumerate(ranges)):
        span = np.frombuffer(_buffer_at(ranges[0][0], (n - 1) * stride + length), dtype=np.uint8)
        strided = np.lib.stride_tricks.as_strided(span, shape=(n, length), strides=(stride, 1))
        packed = np.frombuffer(_buffer_at(contiguous, n * length), dtype=np.uint8).reshape(n, length)
        if gather:
            np.copyto(packed, strided)
        else:
            np.copyto(strided, packed)
        return
    for address, size in ranges:
        if gather:
            ctypes.memmove(contiguous, address, size)
        else:
            ctypes.memmove(address, contiguous, size)
        contiguous += size


class TPUSyncHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is Any to mypy here
    """HiCache L3 pages in tpusync: the pod's sidecar by default."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.config = storage_config
        # A malformed option fails the build here, naming it (tpusync.engines.sglang.options).
        self._options = options = StorageOptions.parse(storage_config.extra_config or {})
        if options.ignored:
            logger.warning("tpusync HiCache storage: ignoring extra config keys %s (docs/sglang.md lists its options)",
                           list(options.ignored))
        self._model = options.model
        self._peers = list(options.peers)
        self._reconnect_interval = options.reconnect_interval_s
        self.mem_pool_host: Any = None
        self._lock = threading.Lock()
        self._store: KVStore | None = None
        self._last_attempt = -1e18
        self._plan: PagePlan | None = None
        self._namespace = b""
        self._scope: KeyScope | None = None
        self._counters: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._reported: set[str] = set()
        self._metrics: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                                 "backup_bandwidth": []}
        self._events = self._make_events(options.kv_events)
        try:
            self._connected()
        except Exception as e:  # noqa: BLE001 - a sidecar that is not up yet is dialled again on use
            self._report("connect", e)

    def _make_events(self, raw: Any) -> StorageEvents | None:
        """The publishing rank's KV events; a bad setting fails SGLang's start with its name."""
        if raw is None:
            return None
        cfg = EventsConfig.parse(raw)
        if self._options.local is not None or self._options.store_url is not None:
            raise errors.InvalidArgumentError("kv_events follows the pod's sidecar (its change feed): "
                                              "leave local and store_url unset")
        if not publishes(self.config):
            return None
        return StorageEvents(cfg, dp_rank=int(getattr(self.config, "dp_rank", 0) or 0),
                             pp_size=int(self.config.pp_size), open_store=self._open,
                             retry_s=max(self._reconnect_interval, 0.1))

    # -- the store ----------------------------------------------------------------------

    def _open(self) -> KVStore:
        options, local = self._options, self._options.local
        if local is not None:
            return KVStore.local(dram_bytes=local.dram_bytes, block_bytes=local.block_bytes,
                                 pool_path=local.pool_path, disk_dir=local.disk_dir, disk_bytes=local.disk_bytes)
        if options.store_url is not None:
            return KVStore.connect(options.store_url, secret_file=options.secret_file, timeout=options.timeout_s)
        return connect_sidecar(options.control_socket, secret_file=options.secret_file)

    def _connected(self) -> KVStore:
        with self._lock:
            if self._store is not None:
                return self._store
            now = time.monotonic()
            if now - self._last_attempt < self._reconnect_interval:
                raise errors.UnavailableError("the store is unreachable; dialling it again shortly")
            self._last_attempt = now
            self._store = self._open()
            self._plan = None  # another store may have another block size
            self._count("connects", 1)
            return self._store

    def _lost(self, store: KVStore) -> None:
        """Drops a store whose connection failed: the next call dials it again (a restarted sidecar)."""
        with self._lock:
            if self._store is store:
                self._store = None
                self._plan = None
                self._last_attempt = -1e18 if self._reconnect_interval <= 0 else time.monotonic()
        with contextlib.suppress(Exception):  # closing a dead connection may fail; nothing to do
            store.close()

    def _ready(self) -> tuple[KVStore, PagePlan, bytes]:
        store = self._connected()
        plan = self._plan
        if plan is None:
            plan = self._make_plan(store)
        return store, plan, self._namespace

    def _make_plan(self, store: KVStore) -> PagePlan:
        pool = self.mem_pool_host
        if pool is None:
            raise errors.PreconditionError("no host pool registered yet (register_mem_pool_host)")
        _, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size, dtype=torch.int64))
        plan = PagePlan(sizes, mla=bool(self.config.is_mla_model), chunk_bytes=store.block_bytes)
        scope = KeyScope.from_config(self.config, pool, model=self._model, geometry=plan.geometry(),
                                     chunk_bytes=store.block_bytes)
        with self._lock:
            self._namespace = scope.namespace()
            self._scope = scope
            self._plan = plan
        return plan

    def _announce(self, store: KVStore, plan: PagePlan, pages: list[str]) -> None:
        """Pages now in the store, to the router (the publishing rank only); never raises."""
        if self._events is None or not pages or self._scope is None:
            return
        try:
            self._events.stored(store, pages, part_keys(self._scope, pages, plan.slots))
        except Exception as e:  # noqa: BLE001 - an announcement is a help to the router, never a failed set
            self._report("kv_events", e)

    # -- reporting -----------------------------------------------------------------------

    def _count(self, name: str, n: int) -> None:
        with self._stats_lock:  # the prefetch and backup threads both count
            self._counters[name] += n

    def _report(self, kind: str, exc: BaseException) -> None:
        self._count(f"errors.{kind}", 1)
        if kind not in self._reported:
            self._reported.add(kind)
            logger.warning("tpusync HiCache storage: %s error, reported as a miss (logged once): %s: %s",
                           kind, type(exc).__name__, exc)

    def _failed(self, op: str, exc: BaseException, store: KVStore | None) -> None:
        if isinstance(exc, errors.CapacityError):
            kind = "capacity"
        elif isinstance(exc, _LOST):
            kind = "unavailable"
            if store is not None:
                self._lost(store)
        elif isinstance(exc, errors.TpuSyncError):
            kind = type(exc).__name__
        else:
            kind = f"unexpected.{type(exc).__name__}"
        self._report(f"{op}.{kind}", exc)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        if self._events is not None:
            self._events.set_page_size(int(mem_pool_host.page_size))
        with self._lock:
            self._plan = None

    # -- the v1 (zero-copy) interface ----------------------------------------------------

    def _page_pointers(self, plan: PagePlan, host_indices: Any, pages: int) -> list[int]:
        pool = self.mem_pool_host
        if int(host_indices.numel()) != pages * pool.page_size:
            raise errors.InvalidArgumentError(
                f"{int(host_indices.numel())} host indices for {pages} pages of {pool.page_size} tokens")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != pages * plan.pieces or tuple(sizes[:plan.pieces]) != plan.sizes:
            raise errors.InvalidArgumentError(f"the pool gave {len(ptrs)} buffers for {pages} pages, expected "
                                              f"{plan.pieces} per page of sizes {plan.sizes}")
        return [int(p) for p in ptrs]

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The leading run of pages held (in any tier), after pulling the rest from peers if configured."""
        if not keys:
            return 0
        store = None
        try:
            store, plan, ns = self._ready()
            per = len(plan.slots)
            flat = block_keys(ns, keys, plan.slots)
            held = local = store.lookup(flat).prefix_len // per
            for peer in self._peers:
                if held >= len(keys):
                    break
                try:
                    got = store.read_remote(peer, flat[held * per:])
                except Exception as e:  # noqa: BLE001 - a peer that fails is a miss
                    self._failed("peer", e, None)
                    continue
                more = next((i for i, ok in enumerate(got) if not ok), len(got)) // per
                self._count("peer_pages", more)
                held += more
            self._count("exists_pages", len(keys))
            self._count("exists_hits", held)
            self._announce(store, plan, keys[local:held])
            return held
        except Exception as e:  # noqa: BLE001 - never into SGLang's cache controller
            self._failed("exists", e, store)
            return 0

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._pages_v1("set", keys, host_indices, self._set_pages)

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._pages_v1("get", keys, host_indices, self._get_pages)

    def _pages_v1(self, op: str, keys: list[str], host_indices: Any,
                  transfer: Callable[[KVStore, PagePlan, list[str], list[bytes], list[int]], list[bool]]) -> list[bool]:
        """One zero-copy batch: the pages' keys and buffer pointers for `transfer`, which says
        which pages it moved; a store error is every page missed, timed and counted either way."""
        if not keys:
            return []
        start = time.perf_counter()
        store = None
        try:
            store, plan, ns = self._ready()
            ptrs = self._page_pointers(plan, host_indices, len(keys))
            ok = transfer(store, plan, keys, block_keys(ns, keys, plan.slots), ptrs)
        except Exception as e:  # noqa: BLE001 - never into SGLang's cache controller
            self._failed(op, e, store)
            ok = [False] * len(keys)
        self._account(op, ok, start)
        return ok

    def _set_pages(self, store: KVStore, plan: PagePlan, keys: list[str], flat: list[bytes],
                   ptrs: list[int]) -> list[bool]:
        try:
            if plan.direct:
                store.put(flat, self._chunk_buffers(plan, ptrs, len(keys)))
            else:
                self._gather_put(store, plan, flat, ptrs, len(keys))
            ok = [True] * len(keys)
        except errors.CapacityError as e:  # what was stored before the store filled stays stored
            self._failed("set", e, store)
            ok = self._pages_held(store, flat, len(plan.slots), len(keys))
        self._announce(store, plan, [k for k, stored in zip(keys, ok) if stored])
        return ok

    def _get_pages(self, store: KVStore, plan: PagePlan, keys: list[str], flat: list[bytes],
                   ptrs: list[int]) -> list[bool]:
        if plan.direct:
            found = store.get(flat, self._chunk_buffers(plan, ptrs, len(keys)))
        else:
            found = self._scatter_get(store, plan, flat, ptrs, len(keys))
        per = len(plan.slots)
        return [all(found[i * per:(i + 1) * per]) for i in range(len(keys))]

    def _chunk_buffers(self, plan: PagePlan, ptrs: list[int], pages: int) -> list[Any]:
        out: list[Any] = []
        for p in range(pages):
            base = p * plan.pieces
            for c in plan.chunks:
                s = c.segments[0]
                out.append(_buffer_at(ptrs[base + s.piece] + s.offset, s.length))
        return out

    def _gather_put(self, store: KVStore, plan: PagePlan, flat: list[bytes], ptrs: list[int], pages: int) -> None:
        per = len(plan.slots)
        if not store.pool_path:  # a data port: no slots here; stage each chunk once
            staged = []
            for i in range(len(flat)):
                chunk, base = plan.chunks[i % per], (i // per) * plan.pieces
                buf = bytearray(chunk.nbytes)
                _copy_segments(_address(memoryview(buf)), self._ranges(chunk, ptrs, base), gather=True)
                staged.append(buf)
            store.put(flat, staged)
            return
        for g in range(0, len(flat), _GATHER_GROUP):
            with store.reserve_many(flat[g:g + _GATHER_GROUP]) as slots:
                for j, slot in enumerate(slots):
                    if slot is None:
                        continue  # already stored
                    i = g + j
                    chunk, base = plan.chunks[i % per], (i // per) * plan.pieces
                    _copy_segments(_address(slot.view), self._ranges(chunk, ptrs, base), gather=True)
                    slot.commit(chunk.nbytes)

    def _scatter_get(self, store: KVStore, plan: PagePlan, flat: list[bytes], ptrs: list[int],
                     pages: int) -> list[bool]:
        per = len(plan.slots)
        found = [False] * len(flat)
        if not store.pool_path:  # a data port: stage each chunk once
            staged = [bytearray(plan.chunks[i % per].nbytes) for i in range(len(flat))]
            got = store.get(flat, staged)
            for i, ok in enumerate(got):
                if ok:
                    self._scatter(plan, i, _address(memoryview(staged[i])), ptrs)
                    found[i] = True
            return found
        for g in range(0, len(flat), _GATHER_GROUP):
            with store.acquire_many(flat[g:g + _GATHER_GROUP]) as views:
                for j, view in enumerate(views):
                    i = g + j
                    if view is None or len(view) != plan.chunks[i % per].nbytes:
                        continue  # absent, or not a chunk of this page's shape: a miss
                    self._scatter(plan, i, _address(view), ptrs)
                    found[i] = True
        return found

    @staticmethod
    def _ranges(chunk: Chunk, ptrs: list[int], base: int) -> list[tuple[int, int]]:
        return [(ptrs[base + s.piece] + s.offset, s.length) for s in chunk.segments]

    def _scatter(self, plan: PagePlan, i: int, src: int, ptrs: list[int]) -> None:
        per = len(plan.slots)
        chunk, base = plan.chunks[i % per], (i // per) * plan.pieces
        _copy_segments(src, self._ranges(chunk, ptrs, base), gather=False)

    def _pages_held(self, store: KVStore, flat: list[bytes], per: int, pages: int) -> list[bool]:
        try:
            tiers = store.where(flat)
        except Exception as e:  # noqa: BLE001
            self._failed("set", e, store)
            return [False] * pages
        return [bool(np.all(tiers[i * per:(i + 1) * per])) for i in range(pages)]

    def _account(self, op: str, ok: list[bool], start: float) -> None:
        elapsed = max(time.perf_counter() - start, 1e-9)
        good = sum(ok)
        self._count(f"{op}_pages", len(ok))
        self._count(f"{op}_ok", good)
        plan = self._plan
        if plan is not None and good:
            self._count(f"{op}_bytes", good * plan.page_bytes)
            name = "backup" if op == "set" else "prefetch"
            with self._stats_lock:
                self._metrics[f"{name}_pgs"].append(len(ok))
                self._metrics[f"{name}_bandwidth"].append(good * plan.page_bytes / elapsed / 1e9)

    # -- the generic interface (flat pages: interface_v1 unset) -----------------------------

    def _flat_buffers(self, plan: PagePlan, tensors: Sequence[Any]) -> list[Any]:
        out: list[Any] = []
        for t in tensors:
            nbytes = int(t.numel()) * int(t.element_size())
            if nbytes != plan.page_bytes or not t.is_contiguous():
                raise errors.InvalidArgumentError(f"a flat page of {nbytes} bytes, the pool's pages hold "
                                                  f"{plan.page_bytes} (contiguous)")
            base = int(t.data_ptr())
            out.extend(_buffer_at(base + c.flat_offset, c.nbytes) for c in plan.chunks)
        return out

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if not keys:
            return []
        store = None
        try:
            store, plan, ns = self._ready()
            targets = list(target_locations) if target_locations is not None else [
                self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
            found = store.get(block_keys(ns, keys, plan.slots), self._flat_buffers(plan, targets))
            per = len(plan.slots)
            out: list[torch.Tensor | None] = [
                t if all(found[i * per:(i + 1) * per]) else None for i, t in enumerate(targets)]
        except Exception as e:  # noqa: BLE001 - never into SGLang's cache controller
            self._failed("get", e, store)
            out = [None] * len(keys)
        self._count("get_pages", len(keys))
        self._count("get_ok", sum(t is not None for t in out))
        return out

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        store = None
        try:
            store, plan, ns = self._ready()
            tensors = [v.contiguous() for v in values]
            store.put(block_keys(ns, keys, plan.slots), self._flat_buffers(plan, tensors))
            ok = True
            self._announce(store, plan, keys)
        except Exception as e:  # noqa: BLE001 - never into SGLang's cache controller
            self._failed("set", e, store)
            ok = False
        self._count("set_pages", len(keys))
        self._count("set_ok", len(keys) if ok else 0)
        return ok

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if value is None:
            return False
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the rest ------------------------------------------------------------------------

    def clear(self) -> bool:
        """Not offered: the store is content-addressed and shared by the host's engines, which
        evicts by LRU; a clear from one engine would drop other engines' pages."""
        self._report("clear", errors.PreconditionError("clear is not supported; the store evicts by LRU"))
        return False

    def counters(self) -> dict[str, int]:
        """Cumulative counters: pages asked and served per operation, bytes, errors by kind."""
        with self._stats_lock:
            return dict(self._counters)

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (what --enable-storage-metrics logs: pages and GB/s per batch
        since the last call), with tpusync's cumulative counters as `.tpusync`."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._stats_lock:
            for name, values in self._metrics.items():
                getattr(metrics, name).extend(values)
                values.clear()
        metrics.tpusync = self.counters()
        return metrics

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

