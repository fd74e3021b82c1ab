"""What the two halves of TPUSyncConnector share besides their messages (messages.py) and the
store (link.py): the logger and the process's counters."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

from tpusync.kv.path_metrics import OFF_REASONS

log = init_logger("vllm.tpusync")  # under vLLM's logging configuration, beside the engine's own lines


# -- counters ---------------------------------------------------------------------------------

class Counters:
    """Totals of what the connectors of this process did (for tests and debugging; each half's
    share also reaches vLLM's metrics through get_kv_connector_stats: its log, and on /metrics
    under the KV path's names, tpusync.engines.connector.prom), and why a connector of this
    process switched itself off."""

    FIELDS = ("requests", "handoffs", "lookups", "matched_requests", "matched_tokens", "pulled_blocks",
              "peer_errors", "store_errors", "loaded_blocks", "load_error_blocks", "saved_blocks", "save_errors",
              "refused_prefills")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)
        self._off: set[str] = set()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def switch_off(self, reason: str) -> None:
        """A connector of this process passes everything through from now on (reason: one of
        tpusync.kv.path_metrics.OFF_REASONS)."""
        if reason not in OFF_REASONS:
            raise ValueError(f"not a connector-off reason: {reason!r}")
        with self._lock:
            self._off.add(reason)

    def off(self) -> set[str]:
        with self._lock:
            return set(self._off)


COUNTERS = Counters()


def stats() -> dict[str, int]:
    """This process's connector totals (see Counters.FIELDS)."""
    return COUNTERS.snapshot()


class Interval:
    """One half's counts since vLLM last took them (each step), also added to the process's
    totals. Thread-safe (the scheduler half counts from its pull threads too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, int] = {}

    def count(self, **counts: int) -> None:
        COUNTERS.add(**counts)
        with self._lock:
            for name, n in counts.items():
                self._data[name] = self._data.get(name, 0) + n

    def take(self) -> TPUSyncStats | None:
        """The interval's counts, and `off:<reason>` = 1 while a connector here is off; None when all are 0."""
        with self._lock:
            out, self._data = self._data, {}
        return off_stats(out)


def off_stats(data: dict[str, int] | None = None) -> TPUSyncStats | None:
    out = dict(data or {}) | {f"{OFF_KEY}{reason}": 1 for reason in sorted(COUNTERS.off())}
    return TPUSyncStats(data=out) if any(out.values()) else None


OFF_KEY = "off:"  # a stats entry off:<reason> = 1: the connector switched itself off for that reason


@dataclass
class TPUSyncStats(KVConnectorStats):
    """Per-interval worker counters for vLLM's KV transfer metrics log."""

    def reset(self) -> None:
        self.data: dict[str, int] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, n in other.data.items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
