"""tpusync's KV connector for vLLM on TPU (tpu-inference): prefix offload and P/D transfer
through the pod's sidecar, for JAX KV caches.

Everything but the worker half is `tpusync.vllm`'s (`tpusync.vllm.base.ConnectorBase`): the
same block keys (the chained prefix hash of the prompt's tokens), lookups and pins, background
pulls from the prefill pod's sidecar of only the blocks this engine lacks, and the same
`kv_transfer_params`, and the same KV events for the tiers tpusync holds, on vLLM's own
publisher when --kv-events-config enables them (docs/vllm.md). One store block is one vLLM
block of every layer: the bytes of page `block_id` of each layer's cache, layer after layer,
in tpu-inference's own layout. The worker half (`tpusync.tpu_inference.worker`) moves pages with `tpusync.pages`.

Steps with loads are marked synchronous (`SchedulerOutput.has_sync_kv_loads`), so vLLM 0.32
runs `start_load_kv` before the forward that reads the loaded pages; tpu-inference has no
per-layer hooks, so a load is one update of every layer.

tpu-inference 0.32.0 accepts only the kv_connector names TPUConnector, TPUConnectorHMA,
TPUOffloadConnector and RaidenOffloadConnector, so this module exports the class as
`TPUConnector` too; vLLM takes it from `kv_connector_module_path`.

Limits: one KV cache group; no tensor or pipeline parallelism yet (the scheduler half looks
up unsharded keys); token-id prompts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpusync.tpu_inference.worker import JaxWorkerSide
from tpusync.vllm.base import ConnectorBase, WorkerHalf
from tpusync.vllm.common import stats

__all__ = ["TPUConnector", "TPUSyncConnector", "stats"]

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput

    from tpusync.vllm.config import ConnectorConfig


class TPUSyncConnector(ConnectorBase):
    """kv_role kv_producer (prefill: saves), kv_consumer (decode: pulls and loads) or kv_both
    (offload); options as for tpusync.vllm (`tpusync.vllm.config`)."""

    def _make_worker(self, cfg: ConnectorConfig) -> WorkerHalf:
        return JaxWorkerSide(cfg)

    def register_runner(self, runner: Any) -> None:
        """tpu-inference hands the model runner over (its kv_caches change every step)."""
        if isinstance(self._worker, JaxWorkerSide):
            self._worker.register_runner(runner)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        if getattr(meta, "loads", None):
            scheduler_output.has_sync_kv_loads = True  # vLLM 0.32 then loads before this step's forward
        return meta


TPUConnector = TPUSyncConnector  # the name tpu-inference's platform accepts
