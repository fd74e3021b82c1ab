"""The KV path's counters, under one set of names every engine exports on its /metrics.

A serving whose prefill-to-decode path silently does nothing still answers every request
(decode recomputes), so HTTP health says nothing about it. Every engine tpusync serves counts
what its KV path did, and exports it in Prometheus' text format beside the engine's own
metrics: vLLM and tpu-inference through vLLM's connector metrics
(KVConnectorBase_V1.build_prom_metrics, tpusync.engines.connector.prom), the reference server
on its /metrics. The operator reads them from each serving pod and reports them in the
DisaggregatedServing's status, with a KVPath condition (operator/tpusync_operator/kv_path.py,
which holds these names again: the two meet on the wire, and a test holds them equal).

    tpusync_kv_requests_total           requests the engine's KV path looked at
    tpusync_kv_handoffs_total           requests that came with a prefill engine's kv_transfer_params
    tpusync_kv_refused_handoffs_total   hand-offs refused (malformed, other KV layout, other keys): recomputed
    tpusync_kv_pulled_blocks_total      blocks pulled from a prefill engine's or a peer's sidecar
    tpusync_kv_pull_failures_total      pulls from a peer that failed
    tpusync_kv_loaded_blocks_total      blocks loaded from the store instead of computed
    tpusync_kv_recomputed_blocks_total  blocks whose load failed, computed again
    tpusync_kv_saved_blocks_total       blocks saved to the store
    tpusync_kv_connector_off{reason}    1 while the engine's tpusync connector passes everything
                                        through (it switched itself off), by why
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

PREFIX = "tpusync_kv_"
COUNTERS: dict[str, str] = {
    "requests": "Requests the engine's tpusync KV path looked at.",
    "handoffs": "Requests that came with a prefill engine's kv_transfer_params.",
    "refused_handoffs": "Hand-offs refused (malformed, another KV layout, other keys): the prompt computed here.",
    "pulled_blocks": "Blocks pulled from a prefill engine's or a peer's sidecar.",
    "pull_failures": "Pulls from a peer that failed.",
    "loaded_blocks": "Blocks loaded from the store instead of computed.",
    "recomputed_blocks": "Blocks whose load failed, computed again.",
    "saved_blocks": "Blocks saved to the store.",
}
OFF = "connector_off"
OFF_HELP = "1 while the engine's tpusync connector passes every request through untouched, by why."
# Why a connector switched itself off: a bounded set, so the label's values stay few.
OFF_REASONS = ("unsupported-config", "store-blocks-too-small", "kv-caches-unreachable")


class PathCounters:
    """One engine's KV-path totals and off reasons. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(COUNTERS, 0)
        self._off: set[str] = set()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._totals[name] += n  # KeyError: not a KV-path counter

    def switch_off(self, reason: str) -> None:
        if reason not in OFF_REASONS:
            raise ValueError(f"not a connector-off reason: {reason!r} (one of {OFF_REASONS})")
        with self._lock:
            self._off.add(reason)

    def snapshot(self) -> tuple[dict[str, int], set[str]]:
        with self._lock:
            return dict(self._totals), set(self._off)

    def prometheus(self, labels: Mapping[str, str] | None = None) -> str:
        totals, off = self.snapshot()
        return render(totals, off, labels)


def render(totals: Mapping[str, int], off: set[str], labels: Mapping[str, str] | None = None) -> str:
    """The counters in Prometheus' text format (0.0.4), each with `labels`."""
    base = ",".join(f'{k}="{_escape(v)}"' for k, v in (labels or {}).items())
    lines = []
    for name, help_ in COUNTERS.items():
        metric = f"{PREFIX}{name}_total"
        lines += [f"# HELP {metric} {help_}", f"# TYPE {metric} counter",
                  f"{metric}{{{base}}} {int(totals.get(name, 0))}"]
    lines += [f"# HELP {PREFIX}{OFF} {OFF_HELP}", f"# TYPE {PREFIX}{OFF} gauge"]
    for reason in OFF_REASONS:
        sep = "," if base else ""
        lines.append(f'{PREFIX}{OFF}{{{base}{sep}reason="{reason}"}} {1 if reason in off else 0}')
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
