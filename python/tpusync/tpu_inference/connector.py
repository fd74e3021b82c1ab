"""tpusync's KV connector for vLLM on TPU (tpu-inference): prefix offload and P/D transfer
through the pod's sidecar, for JAX KV caches.

The scheduler half is the one of `tpusync.vllm` (`tpusync.vllm.scheduler.SchedulerSide`): the
same block keys (the chained prefix hash of the prompt's tokens), lookups and pins, background
pulls from the prefill pod's sidecar of only the blocks this engine lacks, and the same
`kv_transfer_params` (docs/vllm.md). One store block is one vLLM block of every layer: the bytes
of page `block_id` of each layer's cache, layer after layer, in tpu-inference's own layout. The
worker half (`tpusync.tpu_inference.worker`) moves pages with `tpusync.pages`.

Steps with loads are marked synchronous (`SchedulerOutput.has_sync_kv_loads`), so vLLM 0.32
runs `start_load_kv` before the forward that reads the loaded pages; tpu-inference has no
per-layer hooks, so a load is one update of every layer.

tpu-inference 0.32.0 accepts only the kv_connector names TPUConnector, TPUConnectorHMA,
TPUOffloadConnector and RaidenOffloadConnector, so this module exports the class as
`TPUConnector` too; vLLM takes it from `kv_connector_module_path`.

Limits: one KV cache group; no tensor or pipeline parallelism yet (the scheduler half looks
up unsharded keys); token-id prompts. Not yet: KV events for the tiers it fills.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tpusync.tpu_inference.worker import JaxWorkerSide
from tpusync.vllm.common import TPUSyncConnectorMetadata, TPUSyncStats, log, stats
from tpusync.vllm.config import ConnectorConfig
from tpusync.vllm.scheduler import SchedulerSide

__all__ = ["TPUConnector", "TPUSyncConnector", "stats"]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str | None:
    par = vllm_config.parallel_config
    if par.tensor_parallel_size * par.pipeline_parallel_size > 1:
        return "tensor or pipeline parallelism"
    if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
        return "not exactly one KV cache group (hybrid models)"
    return None


class TPUSyncConnector(KVConnectorBase_V1):
    """kv_role kv_producer (prefill: saves), kv_consumer (decode: pulls and loads) or kv_both
    (offload); options as for tpusync.vllm (`tpusync.vllm.config`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        self._cfg = ConnectorConfig.from_extra(kvt.kv_connector_extra_config)
        self._sched: SchedulerSide | None = None
        self._worker: JaxWorkerSide | None = None
        reason = _unsupported(vllm_config, kv_cache_config)
        if reason is not None:
            log.warning("tpusync connector passes requests through untouched: %s is not supported", reason)
            return
        if role == KVConnectorRole.SCHEDULER:
            group = kv_cache_config.kv_cache_groups[0]
            self._sched = SchedulerSide(
                self._cfg, block_size=vllm_config.cache_config.block_size,
                block_bytes=group.kv_cache_spec.page_size_bytes * len(group.layer_names),
                engine_id=str(kvt.engine_id), save=kvt.is_kv_producer, pull=kvt.is_kv_consumer)
        else:
            self._worker = JaxWorkerSide(self._cfg)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # saves finish within the step that computed the blocks

    # -- worker side ----------------------------------------------------------------------------

    def register_runner(self, runner: Any) -> None:
        """tpu-inference hands the model runner over (its kv_caches change every step)."""
        if self._worker is not None:
            self._worker.register_runner(runner)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, TPUSyncConnectorMetadata):
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads are whole before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is not None:
            self._worker.save(meta if isinstance(meta, TPUSyncConnectorMetadata) else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self):
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

    # -- scheduler side -------------------------------------------------------------------------

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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._sched is None:
            return TPUSyncConnectorMetadata()
        meta = self._sched.build_meta(scheduler_output)
        if meta.loads:
            scheduler_output.has_sync_kv_loads = True  # vLLM 0.32 then loads before this step's forward
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is None:
            return False, None
        return False, self._sched.finished(request)  # the blocks are in the store already: free them now


TPUConnector = TPUSyncConnector  # the name tpu-inference's platform accepts
