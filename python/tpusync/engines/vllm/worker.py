"""The worker half of TPUSyncConnector: copies between vLLM's paged KV caches and the pool's
shared-memory slots, layer by layer. Loads and saves finish within their step."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tpusync import errors
from tpusync.engines.connector.common import log
from tpusync.engines.connector.config import ConnectorConfig
from tpusync.engines.connector.link import StoreLink
from tpusync.engines.connector.messages import TPUSyncConnectorMetadata, Transfer, WorkerResults
from tpusync.kv.torch_pages import block_view, register_pool


@dataclass
class _Layer:
    name: str
    blocks: torch.Tensor   # [num_blocks, bytes per block] uint8 view of the layer's KV cache
    offset: int            # where this layer's bytes start in a store block

    @property
    def nbytes(self) -> int:
        return int(self.blocks.shape[1])


class WorkerSide(WorkerResults):
    """Called by TPUSyncConnector's worker-side methods, on the model runner's thread, every step:
    start_load, wait_layer and save_layer (per layer), wait_for_save, then the take_* results."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers: list[_Layer] = []
        self.index: dict[str, int] = {}
        self.block_bytes = 0
        self.link: StoreLink | None = None
        self.loader: ThreadPoolExecutor | None = None  # layerwise loads into a CPU cache run on a thread
        # this step's transfers
        self._load_stack: contextlib.ExitStack | None = None
        self._load_jobs: list[tuple[list[memoryview | None], list[int]]] = []
        self._layer_ready: list[threading.Event] = []
        self._load_future: Future[None] | None = None
        self._waited: list[bool] = []  # layerwise: which layers' attention has waited for its blocks
        self._save_stack: contextlib.ExitStack | None = None
        self._save_slots: list[tuple[Any, torch.Tensor, int]] | None = None
        self._saved_layers: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        offset = 0
        for name, kv in kv_caches.items():
            view = block_view(kv)
            self.index[name] = len(self.layers)
            self.layers.append(_Layer(name, view, offset))
            offset += view.shape[1]
        self.block_bytes = offset
        # On a CUDA device the pool is registered as page-locked host memory: the copies below are
        # DMA straight between the caches and the pool's slots, not staged by CUDA.
        on_cuda = any(kv.device.type == "cuda" for kv in kv_caches.values())
        self.link = StoreLink(self.cfg, offset, "loads and saves", companion=register_pool if on_cuda else None)
        if self.cfg.layerwise and all(kv.device.type == "cpu" for kv in kv_caches.values()):
            self.loader = ThreadPoolExecutor(1, thread_name_prefix="tpusync-load")
        log.info("TPUSyncConnector: %d layers, %d bytes per block, layerwise=%s", len(self.layers), offset,
                 self.cfg.layerwise)

    # loads

    def start_load(self, meta: TPUSyncConnectorMetadata) -> None:
        self._finish_load()
        if not meta.loads:
            return
        for t in meta.loads:
            self.loaded.add(t.req_id)
        store = self.link.get() if self.link is not None and self.layers else None
        if store is None:  # no store, or no KV caches to load into: vLLM computes what was offered
            self._fail_loads(meta.loads)
            return
        keys = list(dict.fromkeys(k for t in meta.loads for k in t.keys))
        stack = contextlib.ExitStack()
        try:
            views = dict(zip(keys, stack.enter_context(store.acquire_many(keys))))
        except errors.TpuSyncError as e:
            stack.close()
            if self.link is not None:
                self.link.failed(e)
            self._fail_loads(meta.loads)
            return
        jobs = []
        for t in meta.loads:
            good = 0
            for key in t.keys:
                view = views[key]
                if view is None or len(view) != self.block_bytes:
                    break  # evicted after all, or stored by an engine with another KV layout
                good += 1
            if good < len(t.keys):
                self.errors.update(t.block_ids[good:])
                self.failed.setdefault(t.req_id, []).append(t.keys[good])  # the rest follow from it
                self._count(load_error_blocks=len(t.keys) - good)
                log.warning("request %s: %d of %d blocks could not be loaded; vLLM recomputes them", t.req_id,
                            len(t.keys) - good, len(t.keys))
            if good:
                jobs.append(([views[k] for k in t.keys[:good]], t.block_ids[:good]))
                self._count(loaded_blocks=good)
        del views
        self._load_stack, self._load_jobs = stack, jobs
        if not jobs:
            self._finish_load()
        elif not self.cfg.layerwise:
            try:
                for i in range(len(self.layers)):
                    self._copy_layer(i)
            except Exception:  # noqa: BLE001 - a copy failed however it failed: vLLM recomputes the blocks
                log.exception("tpusync load failed; vLLM recomputes the blocks")
                self._fail_jobs()
            self._finish_load()
        else:
            self._waited = [False] * len(self.layers)
            if self.loader is not None:
                self._layer_ready = [threading.Event() for _ in self.layers]
                self._load_future = self.loader.submit(self._copy_layers_in_order)

    def _copy_layer(self, i: int) -> None:
        layer = self.layers[i]
        for views, block_ids in self._load_jobs:
            for view, block_id in zip(views, block_ids):
                src = torch.frombuffer(view, dtype=torch.uint8, count=layer.nbytes, offset=layer.offset)
                try:
                    layer.blocks[block_id].copy_(src)
                finally:
                    del src  # no tensor may outlive the lease on the pool slot

    def _copy_layers_in_order(self) -> None:
        """The loader thread (CPU caches): layer after layer, each announced when it is in place."""
        try:
            for i, ready in enumerate(self._layer_ready):
                self._copy_layer(i)
                ready.set()
        finally:
            for ready in self._layer_ready:
                ready.set()

    def wait_layer(self, layer_name: str) -> None:
        i = self.index.get(layer_name)
        if i is None or not self._waited:
            return
        if self._load_future is not None:
            self._layer_ready[i].wait()
        elif not self._waited[i]:  # a device cache: copy on this thread, in the order of vLLM's stream
            try:
                self._copy_layer(i)
            except Exception:  # noqa: BLE001 - a copy failed however it failed: vLLM recomputes the blocks
                log.exception("tpusync load of %s failed; vLLM recomputes the blocks", layer_name)
                self._fail_jobs()
        self._waited[i] = True

    def _finish_load(self) -> None:
        """Waits for the step's copies and lets go of the blocks."""
        if self._load_future is not None:
            try:
                self._load_future.result()
            except Exception:  # noqa: BLE001 - a copy failed however it failed: vLLM recomputes the blocks
                log.exception("tpusync layerwise load failed; vLLM recomputes the blocks")
                self._fail_jobs()
            self._load_future = None
        if self._waited and not all(self._waited):
            # A layer computed without waiting for its blocks may have read them before they arrived.
            log.warning("layers %s did not wait for their KV; vLLM recomputes the blocks",
                        [layer.name for layer, w in zip(self.layers, self._waited) if not w])
            self._fail_jobs()
        self._load_jobs, self._layer_ready, self._waited = [], [], []
        if self._load_stack is not None:
            stack, self._load_stack = self._load_stack, None
            try:
                stack.close()
            except Exception as e:  # noqa: BLE001 - a dead sidecar: its leases went with it
                if self.link is not None:
                    self.link.failed(e)

    def _fail_jobs(self) -> None:
        for _, block_ids in self._load_jobs:
            self.errors.update(block_ids)

    def _fail_loads(self, loads: Iterable[Transfer]) -> None:
        for t in loads:
            self.errors.update(t.block_ids)
            self._count(load_error_blocks=len(t.block_ids))

    # saves

    def save_layer(self, layer_name: str, meta: TPUSyncConnectorMetadata) -> None:
        if not meta.saves or not self.cfg.layerwise:
            return
        i = self.index.get(layer_name)
        if i is None:
            return
        if self._save_slots is None:
            self._reserve(meta)
        self._copy_out(i)

    def _reserve(self, meta: TPUSyncConnectorMetadata) -> None:
        self._save_slots = []
        store = self.link.get() if self.link is not None else None
        if store is None:
            self._count(save_errors=1)
            return
        stack = contextlib.ExitStack()
        self._save_stack = stack
        seen: set[int] = set()
        for t in meta.saves:
            pairs = [(k, b) for k, b in zip(t.keys, t.block_ids) if k not in seen]
            seen.update(k for k, _ in pairs)
            try:
                slots = stack.enter_context(store.reserve_many([k for k, _ in pairs]))
            except errors.CapacityError as e:  # the pool is full of pinned blocks: skip, it is only a cache
                self._count(save_errors=1)
                log.warning("request %s: no room to save %d blocks (%s)", t.req_id, len(pairs), e)
                continue
            except errors.TpuSyncError as e:
                self._count(save_errors=1)
                if self.link is not None:
                    self.link.failed(e)
                return
            for slot, (_, block_id) in zip(slots, pairs):
                if slot is not None:  # None: already stored
                    dst = torch.frombuffer(slot.view, dtype=torch.uint8, count=self.block_bytes)
                    self._save_slots.append((slot, dst, block_id))

    def _copy_out(self, i: int) -> None:
        if i in self._saved_layers:
            return
        layer = self.layers[i]
        for _, dst, block_id in self._save_slots or ():
            dst[layer.offset:layer.offset + layer.nbytes].copy_(layer.blocks[block_id])
        self._saved_layers.add(i)

    def wait_for_save(self, meta: TPUSyncConnectorMetadata | None) -> None:
        self._finish_load()
        try:
            if meta is not None and meta.saves and self.layers:
                if self._save_slots is None:
                    self._reserve(meta)
                for i in range(len(self.layers)):  # every layer not copied by save_kv_layer
                    self._copy_out(i)
                slots = self._save_slots or []
                for slot, _, _ in slots:
                    slot.commit(self.block_bytes)
                self._count(saved_blocks=len(slots))
        except Exception:  # noqa: BLE001 - uncommitted slots are given back: the blocks are just not cached
            self._count(save_errors=1)
            log.exception("tpusync save failed")
        finally:
            self._save_slots, self._saved_layers = None, set()  # drops the tensors over the slots first
            if self._save_stack is not None:
                stack, self._save_stack = self._save_stack, None
                try:
                    stack.close()  # publishes the committed slots
                except Exception as e:  # noqa: BLE001 - a dead sidecar: the blocks are simply not cached
                    self._count(save_errors=1)
                    if self.link is not None:
                        self.link.failed(e)

    def shutdown(self) -> None:
        self._finish_load()
        if self.loader is not None:
            self.loader.shutdown(wait=True)
        if self.link is not None:
            self.link.close()
