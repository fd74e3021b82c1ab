"""TPUSyncConnector: vLLM's KV cache in tpusync's block store (prefix offload, P/D transfer).

One store block is one vLLM block of the prompt, every layer of it: layer after layer (in the
order vLLM registers the KV caches), each the bytes of `kv_cache[block_id]`. It is keyed by the
chained prefix hash of `tpusync.kv.keys` over the prompt's tokens, so the same prefix has the
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

With vLLM's KV events on (`--kv-events-config`), the scheduler half also announces the blocks
the sidecar holds for this engine, at their tier, on vLLM's own publisher (`take_events`,
`tpusync.engines.connector.events`), so llm-d's precise prefix-cache routing sees DRAM and disk as well as
vLLM's GPU cache.

The halves live in `tpusync.engines.connector.scheduler` and `tpusync.engines.vllm.worker`, the connector methods
both connectors share (this one and tpu-inference's) in `tpusync.engines.connector.base`, what the halves
share in `tpusync.engines.connector.common`, the options in `tpusync.engines.connector.config`, and the
kv_transfer_params contract (one typed parser of what a client sends) in `tpusync.kv.handoff`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tpusync.engines.connector.base import ConnectorBase, WorkerHalf
from tpusync.engines.connector.common import COUNTERS, log, stats
from tpusync.engines.connector.config import ConnectorConfig, flag
from tpusync.engines.vllm.worker import WorkerSide
from tpusync.kv.handoff import FORMAT_VLLM

__all__ = ["TPUSyncConnector", "stats"]  # stats(): this process's connector counters

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class TPUSyncConnector(ConnectorBase):
    """vLLM KV connector over tpusync's block store. Configure through kv_transfer_config:
    kv_role kv_producer (prefill: saves), kv_consumer (decode: loads, pulls from the prefill's
    sidecar) or kv_both (offload: both); options in `tpusync.engines.connector.config`."""

    FORMAT = FORMAT_VLLM
    _cache_hit_source = CacheHitSource.HOST

    def _make_worker(self, cfg: ConnectorConfig) -> WorkerHalf:
        return WorkerSide(cfg)

    def _unsupported(self, cfg: ConnectorConfig, vllm_config: VllmConfig, role: KVConnectorRole,
                     kv_cache_config: KVCacheConfig | None) -> str | None:
        reason = super()._unsupported(cfg, vllm_config, role, kv_cache_config)
        if reason is not None:
            return reason
        if cfg.store == "local" and vllm_config.parallel_config.distributed_executor_backend != "uni":
            return ('store "local" with a worker process of its own (the scheduler would not see its store): '
                    'use a sidecar, or distributed_executor_backend="uni"')
        if kv_cache_config is None:
            return "a worker without a KV cache configuration"
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
            return f"KV cache spec {type(spec).__name__} (only full attention)"
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return flag((extra_config or {}).get("layerwise", True))  # layer hooks cannot run inside a CUDA graph

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._worker
        if not isinstance(worker, WorkerSide):
            return
        try:
            worker.register(kv_caches)
        except Exception as e:  # noqa: BLE001 - e.g. caches that are not torch tensors with blocks along dim 0
            COUNTERS.switch_off("kv-caches-unreachable")
            log.warning("TPUSyncConnector cannot reach these KV caches (%s): it loads and saves nothing, and "
                        "vLLM recomputes what its scheduler side offered", e)
            worker.layers, worker.index = [], {}

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if self._sched is None:
            default: dict[CacheHitSource, int] = super().get_external_cache_hit_sources(request, num_external_tokens)
            return default
        return self._sched.hit_sources(request, num_external_tokens)
