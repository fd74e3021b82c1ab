"""TPUSyncConnector: vLLM's KV cache in tpusync's block store (prefix offload, P/D transfer).

One store block is one vLLM block of the prompt, every layer of it: layer after layer (in the
order vLLM registers the KV caches), each the bytes of `kv_cache[block_id]`. It is keyed by the
chained prefix hash of `tpusync.hashing` over the prompt's tokens, so the same prefix has the
same key in every engine that shares the seed, and the block store needs no request ids.

Who calls what (vLLM v1; the scheduler half and the worker half are two instances):

- The scheduler calls `get_num_new_matched_tokens` when a request waits to be scheduled. We
  look up (and pin) the prompt blocks that follow vLLM's own prefix hit in the store. A
  request whose kv_transfer_params name a remote prefill (and the configured `peers`) first
  has the pod's sidecar pull the blocks it lacks, on a background thread: until the pull is
  done we answer None ("ask again"), so the scheduler keeps serving other requests.
  `update_state_after_alloc` learns the vLLM blocks to load into; `build_connector_meta`
  hands the step's loads and saves to the worker; `update_connector_output` drops the pins
  of loads the worker finished; `request_finished` returns the P/D kv_transfer_params.
- The worker calls `start_load_kv` before the forward: it acquires the blocks in the pool
  and (layerwise) copies them layer by layer on a thread, `wait_for_layer_load` waiting for
  each layer in turn. `save_kv_layer` copies each layer of the step's new full prompt blocks
  straight into reserved pool slots, and `wait_for_save` (once per step) publishes them.
  Loads and saves finish within their step: vLLM may free or reuse the blocks right after.

Nothing here fails a request or the engine because of the store: a dead sidecar or peer means
fewer matched tokens (vLLM computes them); a block that cannot be loaded after all is reported
through `get_block_ids_with_load_errors`, which vLLM recomputes when the kv_transfer_config has
`"kv_load_failure_policy": "recompute"` (vLLM's default, "fail", ends such a request with an
error instead). Limits: one KV cache group of full attention, no tensor or pipeline
parallelism, token-id prompts without multimodal inputs; other requests and configurations
pass through untouched. Only prompt blocks are stored, not generated ones.

The halves live in `tpusync.vllm.scheduler` and `tpusync.vllm.worker`, what they share in
`tpusync.vllm.common`, the options and the kv_transfer_params contract in `tpusync.vllm.config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tpusync.vllm.common import TPUSyncConnectorMetadata, TPUSyncStats, log, stats
from tpusync.vllm.config import ConnectorConfig, flag
from tpusync.vllm.scheduler import SchedulerSide
from tpusync.vllm.worker import WorkerSide

__all__ = ["TPUSyncConnector", "stats"]  # stats(): this process's connector counters

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _unsupported(cfg: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str | None:
    par = vllm_config.parallel_config
    if par.tensor_parallel_size * par.pipeline_parallel_size > 1:
        return "tensor or pipeline parallelism (each rank would need its own share of a block)"
    if cfg.store == "local" and par.distributed_executor_backend != "uni":
        return ('store "local" with a worker process of its own (the scheduler would not see its store): '
                'use a sidecar, or distributed_executor_backend="uni"')
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
        return "not exactly one KV cache group (hybrid models)"
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        return f"KV cache spec {type(spec).__name__} (only full attention)"
    return None


class TPUSyncConnector(KVConnectorBase_V1):
    """vLLM KV connector over tpusync's block store. Configure through kv_transfer_config:
    kv_role kv_producer (prefill: saves), kv_consumer (decode: loads, pulls from the prefill's
    sidecar) or kv_both (offload: both); options in `tpusync.vllm.config`."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        self._cfg = ConnectorConfig.from_extra(kvt.kv_connector_extra_config)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        reason = _unsupported(self._cfg, vllm_config, kv_cache_config)
        if reason is not None:
            log.warning("TPUSyncConnector passes requests through untouched: %s is not supported", reason)
            return
        if role == KVConnectorRole.SCHEDULER:
            group = kv_cache_config.kv_cache_groups[0]
            self._sched = SchedulerSide(
                self._cfg, block_size=vllm_config.cache_config.block_size,
                block_bytes=group.kv_cache_spec.page_size_bytes * len(group.layer_names),
                engine_id=str(kvt.engine_id), save=kvt.is_kv_producer, pull=kvt.is_kv_consumer)
        else:
            self._worker = WorkerSide(self._cfg)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # saves finish within the step that computed the blocks

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return flag((extra_config or {}).get("layerwise", True))  # layer hooks cannot run inside a CUDA graph

    # -- worker side (the model runner calls these every step) ---------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is None:
            return
        try:
            self._worker.register(kv_caches)
        except Exception as e:  # e.g. caches that are not torch tensors with blocks along dim 0
            log.warning("TPUSyncConnector cannot reach these KV caches (%s): it loads and saves nothing, and "
                        "vLLM recomputes what its scheduler side offered", e)
            self._worker.layers, self._worker.index = [], {}

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, TPUSyncConnectorMetadata):
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, TPUSyncConnectorMetadata):
            self._worker.save_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            meta = self._connector_metadata
            self._worker.wait_for_save(meta if isinstance(meta, TPUSyncConnectorMetadata) else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TPUSyncStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()

    # -- scheduler side (the scheduler calls these; none may block on a transfer) -----------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._sched is None:
            return 0, False
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._sched is not None:
            self._sched.after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if self._sched is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self._sched.hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._sched is None:
            return TPUSyncConnectorMetadata()
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is None:
            return False, None
        return False, self._sched.finished(request)  # the blocks are in the store already: free them now
