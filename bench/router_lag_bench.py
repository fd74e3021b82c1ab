#!/usr/bin/env python3
"""How long llm-d's router keeps a stale view of what a pod holds: from the change in a
sidecar's tiers to llm-d's own indexer (llm-d-kv-cache v0.9.0, tests/llmd/indexer) scoring the
pod accordingly, polled every 2 ms. Reference engines with real sidecars, as in the llm-d tier
(harness/llmd_fleet.py), with no timed audit: only the engines' change feeds.

Cases (seconds: median of the repetitions; baseline_seconds: lag-announce's in the same run,
the physical baseline of the same kind, an engine's own announcement after a request, through
the same ZMQ socket and indexer; ratio = seconds / baseline):
  lag-announce        a request returns -> the index holds the prompt's blocks for the pod
  lag-demote          store.evict (DRAM -> disk, by the sidecar) -> the index says disk
  lag-evict           store.evict (disk -> gone) -> the pod leaves the score
  lag-shared-publish  a block another host stored on the shared tier -> this pod is scored for it
  lag-shared-evict    the block's file leaves the tier (another host's evictor) -> this pod leaves
The shared cases depend on the sidecar's scan of the tier (--shared-evict-interval-ms, here
100 ms; 10 s by default): they are reported with the interval beside them.

    python bench/router_lag_bench.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from report import merged, report
from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.llmd_fleet import Cluster, connect, parameters  # noqa: E402
from harness.llmd_indexer import build_indexer  # noqa: E402
from tpusync.kv.keys import BlockHasher  # noqa: E402
from tpusync.store import KVStore  # noqa: E402

PAGE = 32
SCAN_MS = 100
NO_AUDIT = ["--kv-events-audit-s", "0"]


def tokens(seed: int, n: int = 320) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def lag(check: Callable[[], bool], start: float | None = None, timeout_s: float = 30) -> float:
    """Seconds from `start` (default: now) until `check()` (a request to the indexer) holds,
    polled every 2 ms."""
    start = time.perf_counter() if start is None else start
    while not check():
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError("the index never showed the change")
        time.sleep(0.002)
    return time.perf_counter() - start


def measure(reps: int, console: Console) -> list[dict]:
    times: dict[str, list[float]] = {c: [] for c in ("lag-announce", "lag-demote", "lag-evict", "lag-shared-publish",
                                                    "lag-shared-evict")}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp))
        try:
            shared = Path(tmp) / "shared"
            shared.mkdir()
            a_host = cluster.host(PAGE, disk=True, shared_dir=shared, shared_scan_ms=SCAN_MS)
            b_host = cluster.host(PAGE, shared_dir=shared, shared_scan_ms=SCAN_MS)
            a, b = cluster.engine(a_host, PAGE, extra=NO_AUDIT), cluster.engine(b_host, PAGE, extra=NO_AUDIT)
            ix = cluster.indexer(parameters(PAGE))
            for e in (a, b):
                connect(ix, e, tokens(990))

            def tiers(prompt: list[int], pod: str) -> dict[str, int]:
                return ix.score(prompt)["pods"].get(pod, {}).get("tiers", {})

            def one(prompt: list[int]) -> dict[str, float]:
                keys = BlockHasher(PAGE).keys(prompt)
                n = len(keys)
                got = {}
                a.complete(prompt)
                served = time.perf_counter()
                got["lag-announce"] = lag(lambda: tiers(prompt, a.pod).get("cpu") == n)
                got["lag-shared-publish"] = lag(lambda: tiers(prompt, b.pod) == {"shared_storage": n}, start=served)
                with KVStore.connect(f"unix://{a_host.sidecar.control_socket}") as store:
                    store.flush()
                    store.evict(keys)  # DRAM -> disk (and still on the shared tier)
                    got["lag-demote"] = lag(lambda: tiers(prompt, a.pod).get("disk") == n)
                    store.evict(keys)  # disk -> gone from a's own tiers
                    got["lag-evict"] = lag(lambda: "disk" not in tiers(prompt, a.pod))
                for f in shared.glob("tpusync-shared-v2/*/*/??/*"):
                    f.unlink()
                got["lag-shared-evict"] = lag(lambda: b.pod not in ix.score(prompt)["pods"])
                return got

            for rep in range(reps):
                console.print(f"  rep {rep + 1}/{reps}")
                for case, t in one(tokens(1000 + rep)).items():
                    times[case].append(t)
        finally:
            cluster.stop()
    base = statistics.median(times["lag-announce"])
    out = []
    for case, ts in times.items():
        med = statistics.median(ts)
        out.append({"case": case, "seconds": med, "baseline_seconds": base, "ratio": med / base,
                    "max_seconds": max(ts), "min_seconds": min(ts), "reps": len(ts),
                    "scan_interval_s": SCAN_MS / 1000 if "shared" in case else None,
                    "load_avg_1m": os.getloadavg()[0]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "router_lag.json"))
    args = ap.parse_args()
    if not os.environ.get("TPUSYNC_LLMD_INDEXER"):  # the llm-d tier's binary (built once, cached)
        os.environ["TPUSYNC_LLMD_INDEXER"] = build_indexer()
    console = Console(width=160)
    results = measure(args.reps, console)
    columns = [("case", "case", ""), ("median s", "seconds", ".4f"), ("min s", "min_seconds", ".4f"),
               ("max s", "max_seconds", ".4f"), ("announce s", "baseline_seconds", ".4f"), ("ratio", "ratio", ".2f"),
               ("scan s", "scan_interval_s", ".1f"), ("load avg", "load_avg_1m", ".1f")]
    report(console, f"llm-d's view of a pod's tiers: lag after each change (median of {args.reps})",
           merged(args.out, results), columns, args.out,
           "ratio = lag / lag-announce (an engine's own announcement after a request, same socket and indexer); "
           "shared cases wait for the other host's scan of the tier (scan s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
