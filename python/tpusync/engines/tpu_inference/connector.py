"""tpusync's KV connector for vLLM on TPU (tpu-inference): prefix offload and P/D transfer
through the pod's sidecar, for JAX KV caches.

Everything but the worker half is `tpusync.engines.vllm`'s (`tpusync.engines.connector.base.ConnectorBase`): the
same block keys (the chained prefix hash of the prompt's tokens), lookups and pins, background
pulls from the prefill pod's sidecar of only the blocks this engine lacks, and the same
`kv_transfer_params`, and the same KV events for the tiers tpusync holds, on vLLM's own
publisher when --kv-events-config enables them (docs/vllm.md). One store block is one vLLM
block of every layer: the bytes of page `block_id` of each layer's cache, layer after layer,
in tpu-inference's own layout. The worker half (`tpusync.engines.tpu_inference.worker`) moves pages with
`tpusync.kv.pages`.

Steps with loads are marked synchronous (`SchedulerOutput.has_sync_kv_loads`), so vLLM 0.32
runs `start_load_kv` before the forward that reads the loaded pages; tpu-inference has no
per-layer hooks, so a load is one update of every layer.

tpu-inference 0.32.0 accepts only the kv_connector names TPUConnector, TPUConnectorHMA,
TPUOffloadConnector and RaidenOffloadConnector, so this module exports the class as
`TPUConnector` too; vLLM takes it from `kv_connector_module_path`.

Tensor parallelism: tpu-inference shards every layer's cache on the mesh's `model` axis, and
the worker half stores each shard's part of a block under its own key (`tpusync.kv.pages`); the
scheduler half looks up, pins and pulls every shard's key (`tpusync.engines.tpu_inference.shards`), so
a block is a hit only when all its shards are there.

Multi-host slices (tpu-inference over Ray, one worker per host, TPU_WORKER_HOSTNAMES naming the
hosts): each host's worker saves and loads the shards its devices hold through its own pod's
sidecar. The scheduler half sees none of those sidecars; it asks every host instead
(`tpusync.engines.connector.common.Probe`): each host pulls the parts its shards need from the prefill's
hosts that hold them (`tpusync.kv.handoff.pull_plan`), looks them up and pins them, and answers in
its step's worker metadata, which vLLM merges across workers (`SliceAnswer`): a block is offered
only when every host holds its parts. A decode of another split or page size reshards on each host as
on one. The prefill names every host's data port and shards in kv_transfer_params
(`remote_addresses`, the layout's `hosts`). KV events announce a block once every host's sidecar
holds its parts, at the tier all of them are in (`tpusync.engines.tpu_inference.shards.SliceView`).

Limits: one KV cache group; pipeline or data parallelism (the connector stays off); token-id
prompts.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tpusync.engines.connector.base import ConnectorBase, WorkerHalf
from tpusync.engines.connector.common import stats
from tpusync.engines.tpu_inference.shards import shard_links
from tpusync.engines.tpu_inference.worker import JaxWorkerSide
from tpusync.kv.handoff import FORMAT_TPU_INFERENCE

__all__ = ["TPUConnector", "TPUSyncConnector", "stats"]

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tpusync.engines.connector.config import ConnectorConfig


class TPUSyncConnector(ConnectorBase):
    """kv_role kv_producer (prefill: saves), kv_consumer (decode: pulls and loads) or kv_both
    (offload); options as for tpusync.engines.vllm (`tpusync.engines.connector.config`)."""

    FORMAT = FORMAT_TPU_INFERENCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        # Blocks are stored as one part per shard of the `model` axis (tpu-inference shards the
        # cache over all tensor-parallel devices).
        self._shards = vllm_config.parallel_config.tensor_parallel_size
        super().__init__(vllm_config, role, kv_cache_config)
        if self._sched is not None:
            assert kv_cache_config is not None  # a scheduler half has one (_unsupported)
            group = kv_cache_config.kv_cache_groups[0]
            block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
            shard_links(self._sched, self._cfg, block_bytes // self._shards, self._shards)

    def _unsupported_parallelism(self, par: ParallelConfig) -> str | None:
        if par.pipeline_parallel_size > 1 or par.data_parallel_size > 1:  # tensor parallelism: shards
            return "pipeline or data parallelism"
        return None

    def _make_worker(self, cfg: ConnectorConfig) -> WorkerHalf:
        return JaxWorkerSide(cfg, self._shards, self._hosts())

    def _hosts(self) -> int:
        """The hosts of the TPU slice (TPU_WORKER_HOSTNAMES, which GKE and the LWS webhook set on
        every pod of a multi-host slice); each host's worker keeps its shards in its own sidecar."""
        return max(1, len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]))

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
