"""The KV path's counters on vLLM's /metrics, under tpusync.kv.path_metrics' names.

vLLM builds a connector's Prometheus metrics in its API server process
(vllm/distributed/kv_transfer/kv_connector/v1/metrics.py, KVConnectorProm, through
KVConnectorBase_V1.build_prom_metrics) and feeds them each step's connector stats: the
scheduler half's and the workers' interval counts, aggregated (vllm/v1/core/sched/scheduler.py,
update_from_output). Those counts carry the connector's own field names (common.Counters);
this maps them onto the KV path's, the names every engine tpusync serves exports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT

from tpusync.engines.connector.common import OFF_KEY
from tpusync.kv.path_metrics import COUNTERS, OFF, OFF_HELP, OFF_REASONS, PREFIX

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# The KV path's counter: the connector's stats field that counts it.
FIELDS = {"requests": "requests", "handoffs": "handoffs", "refused_handoffs": "refused_prefills",
          "pulled_blocks": "pulled_blocks", "pull_failures": "peer_errors", "loaded_blocks": "loaded_blocks",
          "recomputed_blocks": "load_error_blocks", "saved_blocks": "saved_blocks"}
assert set(FIELDS) == set(COUNTERS)


class PathPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        for path, help_ in COUNTERS.items():
            # prometheus_client adds _total to a counter's name
            metric = self._counter_cls(name=f"{PREFIX}{path}", documentation=help_, labelnames=labelnames)
            for idx, values in per_engine_labelvalues.items():
                self._counters[idx, path] = metric.labels(*values)
        off = self._gauge_cls(name=f"{PREFIX}{OFF}", documentation=OFF_HELP, labelnames=[*labelnames, "reason"])
        self._off = {(idx, reason): off.labels(*values, reason)
                     for idx, values in per_engine_labelvalues.items() for reason in OFF_REASONS}
        for gauge in self._off.values():
            gauge.set(0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for path, field in FIELDS.items():
            n = int(transfer_stats_data.get(field, 0) or 0)
            if n > 0:
                self._counters[engine_idx, path].inc(n)
        for reason in OFF_REASONS:
            if transfer_stats_data.get(f"{OFF_KEY}{reason}"):
                self._off[engine_idx, reason].set(1)
