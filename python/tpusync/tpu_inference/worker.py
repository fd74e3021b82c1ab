"""The worker half of tpusync's connector for tpu-inference: pages move between the runner's
JAX KV cache (`runner.kv_caches`, one jax.Array per layer, the page axis first) and the pool's
shared-memory slots, through `tpusync.pages`.

The runner reassigns `runner.kv_caches` every step (its model function donates the cache), so
the connector keeps the runner, not the arrays. Loads run in `start_load_kv`, which vLLM calls
before the forward because the scheduler half marks steps with loads synchronous; one jitted,
donated update puts the pages of every layer in place. Saves run in `wait_for_save`, after the
forward that computed the blocks.
"""

from __future__ import annotations

from typing import Any

import jax

from tpusync import errors, pages
from tpusync.connector.common import StoreLink, TPUSyncConnectorMetadata, WorkerResults, log
from tpusync.connector.config import ConnectorConfig

# The axis tpu-inference splits a layer's cache on over tensor-parallel devices:
# [pages, page_size, kv heads x2 / packing, packing, head_dim] under PartitionSpec(BATCH,
# KV_CONTEXT, KV_HEAD) (tpu_inference/runner/kv_cache.py, create_kv_caches, 0.32.0).
KV_HEAD_AXIS = 2


class JaxWorkerSide(WorkerResults):
    """Called by the connector's worker-side methods on the model runner's thread. tpu-inference
    has no per-layer hooks: loads are whole before the forward, saves after it."""

    def __init__(self, cfg: ConnectorConfig, shards: int = 1) -> None:
        super().__init__()
        self.cfg = cfg
        self.shards = shards  # the scheduler half keys blocks in this many shards
        self.runner: Any = None
        self.block_bytes = 0
        self.link: StoreLink | None = None

    def register_runner(self, runner: Any) -> None:
        self.runner = runner
        self.block_bytes = pages.layer_block_bytes(runner.kv_caches)  # one shard's part of a block
        shards = pages.layer_shard_count(runner.kv_caches)
        if shards != self.shards or jax.process_count() > 1:
            # Loads then fail (vLLM recomputes) and nothing is saved: wrong keys would serve wrong KV.
            log.error("tpusync connector (tpu-inference) stays off: the KV cache is split in %d shards over %d "
                      "hosts, the scheduler half keys blocks in %d shards on one host (tensor_parallel_size)",
                      shards, jax.process_count(), self.shards)
            return
        self.link = StoreLink(self.cfg, self.block_bytes, "loads and saves")
        log.info("tpusync connector (tpu-inference): %d layers of %s %s in %d shards (%s), %d bytes per shard "
                 "of a block", len(runner.kv_caches), runner.kv_caches[0].shape, runner.kv_caches[0].dtype, shards,
                 getattr(runner.kv_caches[0].sharding, "spec", "") if shards > 1 else "unsharded", self.block_bytes)

    def _fail(self, req_id: str, keys: list[int], block_ids: list[int]) -> None:
        """These blocks were offered but are not loaded: vLLM recomputes them."""
        if not block_ids:
            return
        self.errors.update(block_ids)
        self.failed.setdefault(req_id, []).append(keys[0])  # the rest follow from it
        self._count(load_error_blocks=len(block_ids))

    def start_load(self, meta: TPUSyncConnectorMetadata) -> None:
        if not meta.loads:
            return
        store = self.link.get() if self.link is not None else None
        for t in meta.loads:
            self.loaded.add(t.req_id)
            if store is None:
                self._fail(t.req_id, t.keys, t.block_ids)
                continue
            n, store = self._load(store, t)
            self._count(loaded_blocks=n)
            if n < len(t.block_ids):  # pages: with blocks of another page size, not as many as keys
                log.warning("request %s: %d of %d blocks could not be loaded; vLLM recomputes them", t.req_id,
                            len(t.block_ids) - n, len(t.block_ids))
                self._fail(t.req_id, t.keys[t.key_index(n, self.runner.kv_caches[0].shape[1]):], t.block_ids[n:])

    def _load(self, store: Any, t: Any) -> tuple[int, Any]:
        """Loads one request's blocks: (blocks loaded, the store to go on with). A connection that
        fails (the sidecar restarted since it was opened, say) is replaced once, at once where
        retry_s allows, and the load tried again on the new one."""
        assert self.link is not None
        for attempt in range(2):
            try:
                if t.src_tokens or (t.shards and t.shards != self.shards):  # a prefill engine of another
                    # tensor parallelism or page size
                    self.runner.kv_caches, n = pages.load_layer_pages_resharded(
                        store, t.keys, self.runner.kv_caches, t.block_ids, t.shards or self.shards, axis=KV_HEAD_AXIS,
                        src_page_tokens=t.src_tokens, first_token=t.first_token)
                else:
                    self.runner.kv_caches, n = pages.load_layer_pages(store, t.keys, self.runner.kv_caches,
                                                                      t.block_ids)
                return n, store
            except (errors.TpuSyncError, OSError) as e:
                self.link.failed(e)
                store = self.link.get() if attempt == 0 else None
                if store is None:
                    break
        return 0, None

    def wait_layer(self, layer_name: str) -> None:
        pass  # loads are whole before the forward

    def save_layer(self, layer_name: str, meta: TPUSyncConnectorMetadata) -> None:
        pass  # saved after the forward, in wait_for_save

    def wait_for_save(self, meta: TPUSyncConnectorMetadata | None) -> None:
        if meta is None or not meta.saves or self.runner is None or self.link is None:
            return
        store = self.link.get()
        if store is None:
            self._count(save_errors=1)
            return
        for t in meta.saves:
            try:
                written = pages.save_layer_pages(store, t.keys, self.runner.kv_caches, t.block_ids)
            except errors.CapacityError as e:  # the pool is full of pinned blocks: skip, it is only a cache
                self._count(save_errors=1)
                log.warning("request %s: no room to save %d blocks (%s)", t.req_id, len(t.keys), e)
                continue
            except (errors.TpuSyncError, OSError) as e:
                self._count(save_errors=1)
                self.link.failed(e)
                return
            self._count(saved_blocks=written // (self.block_bytes * self.shards))  # every shard of a block

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
