#!/usr/bin/env python3
"""Serving benchmark: time to first token with tpusync vs recomputing the prompt.

For prompts of 1K, 4K and 8K tokens (16K with --long): TTFT when the whole prompt is
recomputed (the baseline, measured in the same run), when its prefix is served from host
DRAM, from the disk tier, or pulled from a peer sidecar; the P/D KV transfer time as a
fraction of the prefill time; and the whole P/D cost (the prefill side's save, the transfer,
the decode side's load, each reported) against the prefill compute. The engine runs in this
process on the reference model; the tiers are real tpusync-sidecar processes on 127.0.0.1.
Prints a table and writes bench/results/serving.json: cases {"case", "tokens", "seconds", "baseline_seconds", "ratio"}.

The tpu-inference case (`--case tpu-inference`, merged into the JSON beside the others; also
run by default when build/tpu-inference-venv exists, `make tpu-inference-venv`): vLLM on
tpu-inference 0.32.0 on the CPU with tpusync's connector, on the tier's tiny Qwen3
(tests/tpu_inference), engines driven in that Python 3.12 environment as subprocesses the way
the tests drive them, sidecars as above. TTFT with the prompt's blocks in a sidecar's DRAM or
on its disk against the same engine build recomputing the prompt; the P/D cost (the prefill
side's extra time to save, the pull between sidecars, the decode side's TTFT loading the pulled
blocks) against recomputing on the decode side; and the decode TTFT when the connector pulls,
by a decode engine like the prefill (pd-decode) and by one of another tensor parallelism and
page size (pd-decode-hetero: two XLA host devices, 16-token pages, loading the prefill's
32-token blocks resharded and regrouped), the latter against the former.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from report import report, report_merged
from rich.console import Console

from tpusync import KVStore, Tier
from tpusync.engines.reference.engine import Engine
from tpusync.engines.reference.model import ModelConfig
from tpusync.local import sidecars as sidecar
from tpusync.local.sidecars import write_secret


def ttft(engine: Engine, prompt: list[int], **kw) -> tuple[float, dict]:
    r = engine.generate(prompt, 1, **kw)
    return r.stats.ttft_seconds, r.stats.as_dict()


ROOT = Path(__file__).resolve().parents[1]
TIER_PY = ROOT / "build" / "tpu-inference-venv" / "bin" / "python"  # make tpu-inference-venv
HETERO_BLOCK_SIZE = 16  # the pd-decode-hetero engine's pages (the others': harness/tinymodel.BLOCK_SIZE)


def tpu_inference_cases(reps: int, console: Console) -> list[dict[str, Any]]:
    """The tpu-inference case: see the module's docstring."""
    sys.path[:0] = [str(ROOT)]
    from harness.tinymodel import BLOCK_BYTES, BLOCK_SIZE
    from harness.tpu_engines import EngineSpec, TpuEngine, rendered_kv_transfer_config
    from tpusync.kv.keys import BlockHasher

    hasher = BlockHasher(BLOCK_SIZE)
    results: list[dict[str, Any]] = []
    engines: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, console.status("tpu-inference: starting engines") as status:
        work = Path(tmp)
        model = work / "model"
        subprocess.run([str(TIER_PY), "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "from harness.tinymodel import build; build(sys.argv[2])", str(ROOT), str(model)],
                       check=True, capture_output=True)
        secret = work / "secret"
        write_secret(secret, uuid.uuid4().hex * 2)
        sides: dict[str, Any] = {}
        try:
            for name, disk in (("host", True), ("prefill", False), ("decode", False), ("hetero", False)):
                sides[name] = sidecar.launch(
                    pool_path=f"/dev/shm/tpusync-sbench-tpuinf-{uuid.uuid4().hex[:8]}", secret_file=str(secret),
                    block_bytes=BLOCK_BYTES, dram_bytes=64 << 20, disk_dir=str(work / "disk") if disk else None,
                    disk_bytes=256 << 20 if disk else 0, control_socket=str(work / f"{name}.sock"),
                    stderr=subprocess.DEVNULL)

            def spec(role: str, side: str, kv_role: str | None = None) -> EngineSpec:
                return EngineSpec(str(model), work, rendered_kv_transfer_config(
                    "tpusync", role, kv_role=kv_role, control_socket=sides[side].control_socket,
                    data_address=sides[side].address))

            specs = {"plain": EngineSpec(str(model), work), "offload": spec("decode", "host", kv_role="kv_both"),
                     "prefill": spec("prefill", "prefill"), "decode": spec("decode", "decode")}
            for name, sp in specs.items():
                engines[name] = TpuEngine(f"bench-{name}", sp, python=str(TIER_PY))
            engines["hetero"] = TpuEngine("bench-hetero", spec("decode", "hetero"), python=str(TIER_PY),
                                          tensor_parallel_size=2, block_size=HETERO_BLOCK_SIZE)
            for e in engines.values():
                e.wait_ready()
            stores = {k: KVStore.connect(f"unix://{s.control_socket}") for k, s in sides.items()}
            rng = np.random.default_rng(1)

            def ttft(engine: str, p: list[int], params: dict | None = None, loads: int | None = None) -> float:
                """The engine's time to the first token; `loads`: the blocks the connector must load."""
                before = engines[engine].stats()
                out = engines[engine].generate(p, 1, kv_transfer_params=params)
                if loads is not None:
                    loaded = engines[engine].stats()["loaded_blocks"] - before["loaded_blocks"]
                    assert loaded == loads, f"{engine}: {loaded} blocks loaded, {loads} expected"
                return float(out["seconds"])

            for n in (500, 1000):
                full = (n - 1) // BLOCK_SIZE  # loadable blocks: the last prompt token is computed
                rows: dict[str, list[float]] = {k: [] for k in ("base", "dram", "disk", "prefill", "transfer",
                                                                "decode_local", "decode_pull", "decode_hetero")}
                for rep in range(reps + 1):  # rep 0 compiles what each path needs: not counted
                    status.update(f"tpu-inference: {n} tokens, rep {rep}")
                    got: dict[str, float] = {}
                    p, q, r, s = (rng.integers(0, 512, n).tolist() for _ in range(4))
                    got["base"] = ttft("plain", p)
                    ttft("offload", p)  # computes and saves
                    engines["offload"].call("reset_prefix_cache")
                    got["dram"] = ttft("offload", p, loads=full)
                    ttft("offload", q)
                    keys = hasher.keys(q)
                    stores["host"].evict(keys)  # DRAM -> disk
                    assert (stores["host"].lookup(keys).tiers == Tier.DISK).all()
                    engines["offload"].call("reset_prefix_cache")
                    got["disk"] = ttft("offload", q, loads=full)
                    pd = {"do_remote_decode": True}
                    base_r = ttft("plain", r)
                    out = engines["prefill"].generate(r, 1, kv_transfer_params=pd)
                    got["prefill"] = float(out["seconds"]) - base_r  # the save's share of the prefill
                    start = time.perf_counter()
                    held = stores["decode"].read_remote(sides["prefill"].address, hasher.keys(r))
                    got["transfer"] = time.perf_counter() - start
                    assert all(held)
                    got["decode_local"] = ttft("decode", r, out["kv_transfer_params"], loads=full)
                    params = engines["prefill"].generate(s, 1, kv_transfer_params=pd)["kv_transfer_params"]
                    got["decode_pull"] = ttft("decode", s, params, loads=full)
                    got["decode_hetero"] = ttft("hetero", s, params, loads=min(  # the prefill's blocks' tokens
                        (n - 1) // HETERO_BLOCK_SIZE, n // BLOCK_SIZE * BLOCK_SIZE // HETERO_BLOCK_SIZE))
                    if rep:
                        for k, v in got.items():
                            rows[k].append(v)
                med = {k: statistics.median(v) for k, v in rows.items()}
                at = {"tokens": n, "baseline_seconds": med["base"], "load_avg_1m": round(os.getloadavg()[0], 2)}
                cases = [("prefix-hit-dram", med["dram"], {}), ("prefix-hit-disk", med["disk"], {}),
                         ("pd-cost", max(med["prefill"], 0.0) + med["transfer"] + med["decode_local"],
                          {"save_seconds": med["prefill"], "transfer_seconds": med["transfer"],
                           "decode_seconds": med["decode_local"]}),
                         ("pd-decode", med["decode_pull"], {})]
                results += [{"case": f"tpu-inference-{case}-{n}", "seconds": sec, "ratio": sec / med["base"], **at,
                             **extra} for case, sec, extra in cases]
                results.append({"case": f"tpu-inference-pd-decode-hetero-{n}", "seconds": med["decode_hetero"],
                                "ratio": med["decode_hetero"] / med["decode_pull"], **at,
                                "baseline_seconds": med["decode_pull"],
                                "baseline": f"tpu-inference-pd-decode-{n}: a decode engine like the prefill"})
        finally:
            for e in engines.values():
                e.stop()
            for sc in sides.values():
                sc.stop()
                if sc.pool_path and os.path.exists(sc.pool_path):
                    os.unlink(sc.pool_path)
    return results


TPU_INFERENCE_COLUMNS = [("case", "case", ""), ("tokens", "tokens", "d"), ("seconds", "seconds", ".4f"),
                         ("baseline s", "baseline_seconds", ".4f"), ("ratio", "ratio", ".3f"),
                         ("save s", "save_seconds", ".4f"), ("transfer s", "transfer_seconds", ".4f"),
                         ("decode s", "decode_seconds", ".4f"), ("load avg", "load_avg_1m", ".2f")]
TPU_INFERENCE_NOTE = (
    "tpu-inference on the CPU, tiny Qwen3 (2 layers), tpusync's connector; median of the reps. baseline: TTFT of "
    "the same engine build recomputing the prompt; prefix-hit: TTFT with the prompt's full blocks in the "
    "sidecar's DRAM / on its disk; pd-cost: the prefill's extra time over the baseline (save s) + the pull between "
    "sidecars (transfer s) + the decode TTFT loading the pulled blocks (decode s); pd-decode: the decode TTFT when "
    "the connector pulls itself; pd-decode-hetero: the same by a decode engine on two devices with 16-token pages "
    "(the prefill: one device, 32), its ratio against pd-decode's seconds")


def run_tpu_inference(args: argparse.Namespace, console: Console) -> int:
    """The tpu-inference case alone: its entries replace their namesakes in the JSON, the
    other cases' entries stay."""
    results = tpu_inference_cases(args.reps, console)
    report_merged(console, "tpusync serving on tpu-inference (CPU): TTFT vs recompute", results,
                  TPU_INFERENCE_COLUMNS, args.out, TPU_INFERENCE_NOTE)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", action="store_true", help="also 16K tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--case", choices=("all", "tpu-inference"), default="all",
                    help="all: the reference engine's cases, then tpu-inference's if its environment is built")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serving.json"))
    args = ap.parse_args()
    console = Console()
    if args.case == "tpu-inference":
        return run_tpu_inference(args, console)
    lengths = [1024, 4096, 8192] + ([16384] if args.long else [])
    cfg = ModelConfig(max_seq=max(lengths) * 2)
    block = -(-cfg.page_bytes // 4096) * 4096
    results = []
    with tempfile.TemporaryDirectory() as work, console.status("starting sidecars") as status:
        secret = os.path.join(work, "secret")
        write_secret(secret, uuid.uuid4().hex * 2)
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
    if TIER_PY.exists():
        return run_tpu_inference(args, console)
    console.print(f"tpu-inference case not run: {TIER_PY} is missing (make tpu-inference-venv)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
