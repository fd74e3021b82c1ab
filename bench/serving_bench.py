#!/usr/bin/env python3
"""Serving benchmark: time to first token with tpusync vs recomputing the prompt.

For prompts of 1K, 4K and 8K tokens (16K with --long): TTFT when the whole prompt is
recomputed (the baseline, measured in the same run), when its prefix is served from host
DRAM, from the disk tier, or pulled from a peer sidecar; the P/D KV transfer time as a
fraction of the prefill time; and the whole P/D cost (the prefill side's save, the transfer,
the decode side's load, each reported) against the prefill compute. The engine runs in this
process on the reference model; the tiers are real tpusync-sidecar processes on 127.0.0.1.
Prints a table and writes bench/results/serving.json: cases {"case", "tokens", "seconds", "baseline_seconds", "ratio"}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np
from report import report
from rich.console import Console

from tpusync import KVStore, Tier, sidecar
from tpusync.serving.engine import Engine
from tpusync.serving.model import ModelConfig


def ttft(engine: Engine, prompt: list[int], **kw) -> tuple[float, dict]:
    r = engine.generate(prompt, 1, **kw)
    return r.stats.ttft_seconds, r.stats.as_dict()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", action="store_true", help="also 16K tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serving.json"))
    args = ap.parse_args()
    lengths = [1024, 4096, 8192] + ([16384] if args.long else [])
    cfg = ModelConfig(max_seq=max(lengths) * 2)
    block = -(-cfg.page_bytes // 4096) * 4096
    console = Console()
    results = []
    with tempfile.TemporaryDirectory() as work, console.status("starting sidecars") as status:
        secret = os.path.join(work, "secret")
        Path(secret).write_text(uuid.uuid4().hex * 2)
        pools = []

        def side(name: str, **kw):
            pools.append(f"/dev/shm/tpusync-sbench-{uuid.uuid4().hex[:8]}")
            return sidecar.launch(pool_path=pools[-1], secret_file=secret, block_bytes=block,
                                  control_socket=os.path.join(work, f"{name}.sock"), stderr=subprocess.DEVNULL, **kw)

        big = 4 * max(lengths) * cfg.page_bytes // cfg.page_size * 2
        sides = {"dram": side("dram", dram_bytes=big), "disk": side("disk", dram_bytes=64 * block,
                                                                    disk_dir=os.path.join(work, "disk"),
                                                                    disk_bytes=big),
                 "peer": side("peer", dram_bytes=big), "prefill": side("prefill", dram_bytes=big),
                 "decode": side("decode", dram_bytes=big)}
        try:
            stores = {k: KVStore.connect(f"unix://{s.control_socket}") for k, s in sides.items()}
            status.update("compiling the model")
            plain = Engine(cfg, role="both")
            plain.warm_up()
            dram = Engine(cfg, role="both", store=stores["dram"])
            disk = Engine(cfg, role="both", store=stores["disk"])
            peer = Engine(cfg, role="both", store=stores["peer"], peers=[sides["dram"].address])
            prefill = Engine(cfg, role="prefill", store=stores["prefill"], data_address=sides["prefill"].address)
            decode = Engine(cfg, role="decode", store=stores["decode"])
            rng = np.random.default_rng(0)
            for n in lengths:
                label = f"{n // 1024}k"
                status.update(f"{n} tokens: recompute")
                base = statistics.median(ttft(plain, rng.integers(0, 256, n).tolist())[0] for _ in range(args.reps))
                rows = {"prefix-hit-dram": [], "prefix-hit-disk": [], "prefix-hit-peer": [], "pd-transfer": []}
                prefill_times = []
                pd_parts: list[tuple[float, float, float]] = []  # (save, transfer, load) per rep
                for _ in range(args.reps):
                    p = rng.integers(0, 256, n).tolist()
                    status.update(f"{n} tokens: DRAM, disk, peer, P/D")
                    ttft(dram, p)  # computes and saves
                    rows["prefix-hit-dram"].append(ttft(dram, p)[0])
                    ttft(disk, p)
                    stores["disk"].flush()
                    keys = disk.hasher.keys(p)
                    tiers = stores["disk"].lookup(keys).tiers
                    # DRAM copies down to the disk tier (evicting a disk-only block would drop it)
                    stores["disk"].evict([k for k, t in zip(keys, tiers) if t in (Tier.DRAM, Tier.DRAM_AND_DISK)])
                    assert (stores["disk"].lookup(keys).tiers == Tier.DISK).all()
                    rows["prefix-hit-disk"].append(ttft(disk, p)[0])
                    rows["prefix-hit-peer"].append(ttft(peer, p)[0])  # pulled from the DRAM host
                    stores["peer"].evict(keys)  # the next rep pulls again
                    r = prefill.generate(p, 1)
                    prefill_times.append(r.stats.prefill_seconds)
                    _, d = ttft(decode, p, kv_transfer_params=r.kv_transfer_params)
                    rows["pd-transfer"].append(d["transfer_seconds"])
                    pd_parts.append((r.stats.save_seconds, d["transfer_seconds"], d["load_seconds"]))
                    stores["decode"].evict(keys)
                for case, times in rows.items():
                    seconds = statistics.median(times)
                    baseline = statistics.median(prefill_times) if case == "pd-transfer" else base
                    results.append({"case": f"{case}-{label}", "tokens": n, "seconds": seconds,
                                    "baseline_seconds": baseline, "ratio": seconds / baseline})
                save, transfer, load = (statistics.median(part) for part in zip(*pd_parts))
                prefill_s = statistics.median(prefill_times)
                results.append({"case": f"pd-cost-{label}", "tokens": n, "seconds": save + transfer + load,
                                "baseline_seconds": prefill_s, "ratio": (save + transfer + load) / prefill_s,
                                "save_seconds": save, "transfer_seconds": transfer, "load_seconds": load})
        finally:
            for s in sides.values():
                s.stop()
            for pool in pools:
                if os.path.exists(pool):
                    os.unlink(pool)

    report(console, f"tpusync serving: TTFT vs recompute ({cfg.layers} layers, d_model {cfg.d_model}, "
           f"{cfg.page_bytes // 1024} KiB per {cfg.page_size}-token page, median of {args.reps})", results,
           [("case", "case", ""), ("tokens", "tokens", "d"), ("seconds", "seconds", ".4f"),
            ("baseline s", "baseline_seconds", ".4f"), ("ratio", "ratio", ".3f"),
            ("save s", "save_seconds", ".4f"), ("transfer s", "transfer_seconds", ".4f"),
            ("load s", "load_seconds", ".4f")], args.out,
           "baseline: TTFT recomputing the whole prompt; pd-transfer: KV transfer time / prefill time; "
           "pd-cost: (prefill side's save + transfer + decode side's load) / prefill time, each part shown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
