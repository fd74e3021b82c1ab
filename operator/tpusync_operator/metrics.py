"""Prometheus metrics of the operator itself."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("tpusync_operator_reconcile_total", "Reconcile passes by kind and result.",
                     ["kind", "result"])
RECONCILE_SECONDS = Histogram("tpusync_operator_reconcile_seconds", "Duration of one reconcile pass.", ["kind"],
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
READY = Gauge("tpusync_operator_object_ready", "1 when the object's Ready condition is True.",
              ["kind", "namespace", "name"])


def serve(port: int, address: str = "0.0.0.0") -> None:
    start_http_server(port, addr=address)
