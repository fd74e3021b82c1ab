"""What every tpusync KV connector for vLLM shares, whatever holds the KV cache: the scheduler
half (`tpusync.engines.connector.scheduler.SchedulerSide`), the KV events of the tiers tpusync holds
(`tpusync.engines.connector.events`), and the wiring of a worker half to vLLM's worker-side calls.

`tpusync.vllm.connector.TPUSyncConnector` (torch KV caches) and
`tpusync.tpu_inference.connector.TPUSyncConnector` (JAX KV caches on tpu-inference) subclass
`ConnectorBase` and bring their worker half (a `WorkerHalf`): how it finds the KV caches and
when it copies. No torch here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tpusync.engines.connector.common import COUNTERS, TPUSyncStats, log, off_stats
from tpusync.engines.connector.config import ConnectorConfig
from tpusync.engines.connector.messages import TPUSyncConnectorMetadata, TPUSyncWorkerMetadata
from tpusync.engines.connector.prom import PathPromMetrics
from tpusync.engines.connector.scheduler import SchedulerSide
from tpusync.kv.keys import BlockScope

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import KVEventsConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class WorkerHalf(Protocol):
    """A connector's worker half, called on the model runner's thread every step: start_load,
    wait_layer and save_layer per layer (where the platform has layer hooks), wait_for_save,
    then the take_* results (tpusync.engines.connector.common.WorkerResults has those)."""

    def start_load(self, meta: TPUSyncConnectorMetadata) -> None: ...
    def wait_layer(self, layer_name: str) -> None: ...
    def save_layer(self, layer_name: str, meta: TPUSyncConnectorMetadata) -> None: ...
    def wait_for_save(self, meta: TPUSyncConnectorMetadata | None) -> None: ...
    def take_errors(self) -> set[int]: ...
    def take_worker_meta(self) -> TPUSyncWorkerMetadata | None: ...
    def take_stats(self) -> TPUSyncStats | None: ...
    def shutdown(self) -> None: ...


def kv_events(vllm_config: VllmConfig) -> KVEventsConfig | None:
    """The engine's KV-events configuration, if it publishes them (--kv-events-config)."""
    events = vllm_config.kv_events_config
    return events if events is not None and events.enable_kv_cache_events else None


class ConnectorBase(KVConnectorBase_V1):
    """A tpusync KV connector; subclasses give `_make_worker` and FORMAT, and may narrow `_unsupported`."""

    FORMAT = ""  # how the worker half arranges a block's bytes (tpusync.kv.handoff.FORMAT_*)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        kvt = self._kv_transfer_config
        self._cfg = ConnectorConfig.from_extra(kvt.kv_connector_extra_config)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerHalf | None = None
        reason = self._unsupported(self._cfg, vllm_config, role, kv_cache_config)
        if reason is not None:
            COUNTERS.switch_off("unsupported-config")
            log.warning("%s passes requests through untouched: %s is not supported", type(self).__name__, reason)
            return
        if role == KVConnectorRole.SCHEDULER:
            assert kv_cache_config is not None  # _unsupported says so otherwise
            group = kv_cache_config.kv_cache_groups[0]
            model = vllm_config.model_config
            scope = BlockScope(model=str(model.model), dtype=str(group.kv_cache_spec.dtype),
                               layers=len(group.layer_names), kv_heads=model.get_total_num_kv_heads(),
                               head_size=model.get_head_size(), page_tokens=vllm_config.cache_config.block_size,
                               format=self.FORMAT, shards=vllm_config.parallel_config.tensor_parallel_size,
                               seed=self._cfg.hash_seed)
            self._sched = SchedulerSide(
                self._cfg, scope,
                block_bytes=group.kv_cache_spec.page_size_bytes * len(group.layer_names),
                engine_id=str(kvt.engine_id), save=kvt.is_kv_producer, pull=kvt.is_kv_consumer,
                kv_events=kv_events(vllm_config), dp_rank=vllm_config.parallel_config.data_parallel_index,
                hosts=self._hosts())
        else:
            self._worker = self._make_worker(self._cfg)

    def _make_worker(self, cfg: ConnectorConfig) -> WorkerHalf:
        raise NotImplementedError

    def _hosts(self) -> int:
        """The hosts of the slice the engine runs on, each with its own workers and sidecar."""
        return 1

    def _unsupported(self, cfg: ConnectorConfig, vllm_config: VllmConfig, role: KVConnectorRole,
                     kv_cache_config: KVCacheConfig | None) -> str | None:
        """Why this configuration is passed through untouched, or None."""
        reason = self._unsupported_parallelism(vllm_config.parallel_config)
        if reason is not None:
            return reason
        if kv_cache_config is None:
            return None if role != KVConnectorRole.SCHEDULER else "a scheduler without a KV cache configuration"
        if len(kv_cache_config.kv_cache_groups) != 1:
            return "not exactly one KV cache group (hybrid models)"
        return None

    def _unsupported_parallelism(self, par: ParallelConfig) -> str | None:
        """The parallelism this engine's connector cannot serve, or None."""
        if par.tensor_parallel_size * par.pipeline_parallel_size > 1:
            return "tensor or pipeline parallelism (each rank would need its own share of a block)"
        return None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # saves finish within the step that computed the blocks

    # -- worker side (the model runner calls these every step) ---------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, TPUSyncConnectorMetadata):
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
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
        """This half's counts since the last step (vLLM aggregates the scheduler's and the
        workers'), with the reasons a connector of this process is off."""
        if self._worker is not None:
            return self._worker.take_stats()
        if self._sched is not None:
            return self._sched.interval.take()
        return off_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TPUSyncStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        """The KV path's counters on vLLM's /metrics (tpusync.kv.path_metrics' names)."""
        return PathPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

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

    def reset_cache(self) -> bool | None:
        """vLLM cleared its own caches and asks the connector to (pause with clear_cache does, as
        around a weight update): KV saved before is not loaded again (tpusync.kv.served_weights)."""
        if self._sched is None:
            return None
        self._sched.reset()
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The KV events of the tiers tpusync holds; vLLM's scheduler publishes them after its own
        every step (tpusync.engines.connector.events)."""
        return self._sched.take_events() if self._sched is not None else ()
