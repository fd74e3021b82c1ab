"""Counters of tpusync.engines.upstream's managers in this process (an engine's stats)."""

from __future__ import annotations

import threading

_counters = dict.fromkeys(("d2h_blocks", "h2d_blocks", "reclaimed_blocks", "copy_errors", "pool_full",
                           "registered_blocks", "pulled_blocks", "acked_sends", "expired_sends", "failed_pulls"), 0)
_lock = threading.Lock()


def stats() -> dict[str, int]:
    """Blocks copied each way through the host pool and reclaimed, copies that failed,
    allocations refused because every host block was locked; blocks registered for and pulled
    by transfers, sends acknowledged or expired, pulls that failed."""
    with _lock:
        return dict(_counters)


def count(**kw: int) -> None:
    with _lock:
        for k, v in kw.items():
            _counters[k] += v
