#!/usr/bin/env python3
"""In-place weight updates into running engines: publish -> every sampler serving version N.

Run with the vLLM tier's interpreter (`build/vllm-venv/bin/python bench/inplace_bench.py`;
`make bench-inplace` builds it); tpu-inference engines run on that tier's interpreter when it
is built (build/tpu-inference-venv). For a random Qwen3 of --hidden/--layers (float32,
checkpoint B published by a torch trainer holding it), measured in one run:

- inplace-vllm-<model>: two vLLM engines on one sampler host; the trainer host publishes B,
  pushes one copy to the sampler host's sidecar, both engines load it in place (vLLM's
  weight-transfer API, backend tpusync). Baseline, the engine reload: a vLLM engine started
  from checkpoint B (process start to serving), what an RL loop without in-place updates
  pays per version. ratio = in-place seconds / reload seconds (target <= 0.5).
- naive-vllm-<model>: the same, each sampler on a host of its own, pulling its own copy.
- inplace-tpu-inference-<model>: one tpu-inference engine (JAX on the CPU) updated in place
  (tpusync.engines.tpu_inference.weights) against its own restart on checkpoint B.
- link-raw-<model>: four raw TCP streams carrying the version's bytes (the loopback link);
  each case's `link_ratio` is its transfer's throughput over this.
Every engine's tokens after the update are checked against an engine started on B. The timed
updates follow untimed ones that fill every pool and map its pages in every engine once, as in an
RL loop's steady state.
- inplace-*-floor: the same update against its floor, the link's time for the bytes (link-raw)
  plus the engines' own update calls fed from tensors already in their memory
  (harness/load_floor.py), every engine at once; ratio = update seconds / floor (target <= 1.3).
Writes the cases into bench/results/weight_sync.json beside the weight-sync bench's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from rich.console import Console

from tpusync.local.sidecars import write_secret

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import rawtcp  # noqa: E402
from report import merged, report  # noqa: E402

from harness.engines import EngineSpec, prompt  # noqa: E402
from harness.tinymodel import build  # noqa: E402
from tpusync import KVStore, VersionedWeights  # noqa: E402
from tpusync.local import sidecars as sidecar_mod  # noqa: E402

MODEL = "bench-policy"
WARM_VERSIONS = 4  # untimed, before the timed ones: the pools hold four versions
TPU_PY = ROOT / "build" / "tpu-inference-venv" / "bin" / "python"


def sidecars(work: Path, names: list[str], dram: int) -> dict:
    secret = work / "secret"
    write_secret(secret, os.urandom(16).hex().encode() + b"\n")
    out = {}
    for n in names:
        out[n] = sidecar_mod.launch(pool_path=f"/dev/shm/tpusync-inplace-{os.getpid()}-{n}-{uuid.uuid4().hex[:6]}",
                                    secret_file=str(secret), dram_bytes=dram, block_bytes=2 << 20,
                                    control_socket=str(work / f"{n}.sock"))
    return out


def timed_start(start, *args, **kw) -> tuple[object, float]:
    t = time.perf_counter()
    engine = start(*args, **kw).wait_ready()
    return engine, time.perf_counter() - t


def update_all(engines, socket: str, version: int, tpu: bool = False, floor: bool = False) -> None:
    """Every engine loads `version` at once (each in its own thread: they are processes), through
    the engine's update calls; `floor`: the same calls, the load fed from the tensors each worker
    staged in its memory (load_floor.py) instead of tpusync's pool."""
    def one(e):
        e.weights("start_weight_update")
        if floor:
            e.weights("collective_rpc", "tpusync_load_floor")
        elif tpu:
            e.weights("collective_rpc", "tpusync_update_weights",
                      kwargs={"model": MODEL, "version": version, "control_socket": socket})
        else:
            e.weights("update_weights", {"update_info": {"version": version}})
        e.weights("finish_weight_update", *([] if tpu else [str(version)]))
        e.call("reset_prefix_cache")
    threads = [threading.Thread(target=one, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def load_floor(engines, ckpt: Path, reps: int, tpu: bool = False) -> float:
    """The median over `reps` of every engine's update calls at once with the load fed from memory:
    each worker stages the checkpoint's tensors first (untimed)."""
    runs = []
    for _ in range(reps):
        for e in engines:
            e.weights("collective_rpc", "tpusync_stage_floor", kwargs={"checkpoint": str(ckpt)})
        t0 = time.perf_counter()
        update_all(engines, "", 0, tpu=tpu, floor=True)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def floor_case(name: str, nbytes: int, seconds: float, link_s: float, load_s: float, samplers: int) -> dict:
    """An update against its floor: the link's time for the bytes plus the engines' own load."""
    floor = link_s + load_s
    return {"case": f"{name}-floor", "bytes": nbytes, "seconds": seconds, "baseline_seconds": floor,
            "ratio": seconds / floor, "gbps": nbytes / seconds / 1e9, "link_seconds": link_s,
            "load_seconds": load_s, "samplers": samplers}


def measure(args, work: Path, cars: dict, ckpt_a: Path, ckpt_b: Path, params: dict, nbytes: int, tag: str,
            console: Console) -> list[dict]:
    engines: list = []
    trainer = VersionedWeights(KVStore.connect(f"unix://{cars['t'].control_socket}"), MODEL)
    try:
        return _measure(args, work, cars, ckpt_a, ckpt_b, params, nbytes, tag, console, engines, trainer)
    finally:
        for e in engines:
            e.stop()
        trainer.close()


def _measure(args, work, cars, ckpt_a, ckpt_b, params, nbytes, tag, console, engines, trainer) -> list[dict]:
    """The cases, on started sidecars; every engine started goes into `engines` (stopped by the caller)."""
    results = []
    raw = rawtcp.run(nbytes, 4, 3)
    results.append({"case": f"link-raw-{tag}", "bytes": nbytes, "seconds": raw.seconds, "ratio": 1.0,
                    "baseline_seconds": raw.seconds, "gbps": nbytes / raw.seconds / 1e9})

    kv = 256 << 20
    base = EngineSpec(str(ckpt_a), work, kv_cache_bytes=kv, worker_extension_cls="load_floor.VllmLoadFloor")
    base = base.weight_transfer()
    fresh, reload_s = timed_start(EngineSpec(str(ckpt_b), work, kv_cache_bytes=kv).start, "fresh")
    p = prompt(1, 64, vocab=min(args.vocab, 512))
    want = fresh.generate(p)["token_ids"]
    fresh.stop()
    samplers = [base.start(f"s{i}") for i in range(2)]
    lone = base.start("lone")
    engines.extend([*samplers, lone])
    for e in engines:
        e.wait_ready()
    for e, car in ((samplers[0], "w"), (samplers[1], "w"), (lone, "w2")):
        e.weights("init_weight_transfer_engine", {"init_info": {"model": MODEL,
                                                                "control_socket": cars[car].control_socket}})

    def inplace(version: int) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        trainer.publish(params, version)
        t1 = time.perf_counter()
        trainer.push_weights([cars["w"].address], version).result()
        t2 = time.perf_counter()
        update_all(samplers, "", version)
        return time.perf_counter() - t0, t2 - t1, t2 - t0

    def naive(version: int) -> float:
        t0 = time.perf_counter()
        trainer.publish(params, version)
        for car in ("w", "w2"):  # each sampler's host gets its own copy
            trainer.push_weights([cars[car].address], version).result()
        update_all([samplers[0], lone], "", version)
        return time.perf_counter() - t0

    # The steady state of an RL loop: every slot of the pools written and every page mapped by
    # each process once (a fresh pool's first touch, some 0.2 s per GB here, is paid once, not
    # per version). The pools hold four versions.
    v = 0
    for _ in range(WARM_VERSIONS):
        inplace(v := v + 1)
        naive(v := v + 1)
    runs = [inplace(v + i) for i in range(1, args.reps + 1)]
    v += args.reps
    for e in samplers:
        assert e.generate(p)["token_ids"] == want, "an engine updated in place does not generate what B does"
    total, push, to_host = (statistics.median(r[i] for r in runs) for i in range(3))
    results.append({"case": f"inplace-vllm-{tag}", "bytes": nbytes, "seconds": total, "baseline_seconds": reload_s,
                    "ratio": total / reload_s, "gbps": nbytes / total / 1e9, "samplers": 2,
                    "push_seconds": push, "publish_push_seconds": to_host,
                    "link_ratio": (nbytes / push) / (nbytes / raw.seconds),
                    "min_seconds": min(r[0] for r in runs), "max_seconds": max(r[0] for r in runs)})
    load_s = load_floor(samplers, ckpt_b, args.reps)  # after the checks: it loads B too
    results.append(floor_case(f"inplace-vllm-{tag}", nbytes, total, raw.seconds, load_s, 2))
    nv = statistics.median(naive(v + i) for i in range(1, args.reps + 1))
    v += args.reps
    results.append({"case": f"naive-vllm-{tag}", "bytes": nbytes, "seconds": nv, "baseline_seconds": total,
                    "ratio": nv / total, "gbps": nbytes / nv / 1e9, "samplers": 2})
    for e in [*samplers, lone]:
        e.stop()  # before the tpu-inference engines: this machine's memory

    if TPU_PY.exists():
        from harness.tpu_engines import TpuEngine

        ext = "load_floor.TpuLoadFloor"  # tpusync's WeightUpdate, and the floor's load
        tfresh, tpu_reload = timed_start(TpuEngine, "tpu-fresh", EngineSpec(str(ckpt_b), work), python=str(TPU_PY))
        twant = tfresh.generate(p)["token_ids"]
        tfresh.stop()
        tpu = TpuEngine("tpu", EngineSpec(str(ckpt_a), work), python=str(TPU_PY), worker_extension_cls=ext)
        engines.append(tpu)
        tpu.wait_ready()
        tpu_runs = []
        for i in range(WARM_VERSIONS + args.reps):  # the first ones warm its mapping of the pool
            t0 = time.perf_counter()
            trainer.publish(params, v := v + 1)
            trainer.push_weights([cars["w"].address], v).result()
            update_all([tpu], cars["w"].control_socket, v, tpu=True)
            if i >= WARM_VERSIONS:
                tpu_runs.append(time.perf_counter() - t0)
        assert tpu.generate(p)["token_ids"] == twant, "tpu-inference updated in place differs from B"
        tpu_load = load_floor([tpu], ckpt_b, args.reps, tpu=True)
        tpu.stop()
        t = statistics.median(tpu_runs)
        results.append({"case": f"inplace-tpu-inference-{tag}", "bytes": nbytes, "seconds": t,
                        "baseline_seconds": tpu_reload, "ratio": t / tpu_reload, "gbps": nbytes / t / 1e9,
                        "samplers": 1, "min_seconds": min(tpu_runs), "max_seconds": max(tpu_runs)})
        results.append(floor_case(f"inplace-tpu-inference-{tag}", nbytes, t, raw.seconds, tpu_load, 1))
    else:
        console.print(f"[yellow]{TPU_PY} is not built (make tpu-inference-venv): no tpu-inference case")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3, help="in-place updates measured (median)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "weight_sync.json"))
    args = ap.parse_args()

    import torch
    from transformers import Qwen3ForCausalLM

    console = Console(width=200)
    results: list[dict] = []
    sizes = {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers,
                 "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 128),
                 "head_dim": 64, "vocab_size": args.vocab}
    with tempfile.TemporaryDirectory(prefix="tpusync-inplace-") as tmp:
        work = Path(tmp)
        ckpt_a, ckpt_b = build(work / "a", 0, **sizes), build(work / "b", 1, **sizes)
        params = dict(Qwen3ForCausalLM.from_pretrained(ckpt_b, dtype=torch.float32).named_parameters())
        nbytes = sum(p.numel() * p.element_size() for p in params.values())
        tag = f"qwen3-{sum(p.numel() for p in params.values()) / 1e6:.0f}m"
        console.print(f"model {tag}: {nbytes / 2**30:.2f} GiB float32")
        cars = sidecars(work, ["t", "w", "w2"], dram=4 * nbytes)  # two versions, and leaves rounded up to blocks
        try:
            results += measure(args, work, cars, ckpt_a, ckpt_b, params, nbytes, tag, console)
        finally:
            for car in cars.values():
                car.stop()
                car.remove_pool()

    columns = [("case", "case", ""), ("seconds", "seconds", ".2f"), ("baseline s", "baseline_seconds", ".2f"),
               ("ratio", "ratio", ".2f"), ("GB/s", "gbps", ".2f"), ("push s", "push_seconds", ".2f"),
               ("vs link", "link_ratio", ".2f"), ("link s", "link_seconds", ".2f"), ("load s", "load_seconds", ".2f")]
    note = ("inplace-*: publish on the trainer host -> one copy pushed to the samplers' host -> every engine serving "
            "the version; baseline = an engine started from the checkpoint (the reload an RL loop would pay). "
            "naive-vllm: each sampler's host pulls its own copy; baseline = inplace. vs link: the push's throughput "
            "over four raw TCP streams'. *-floor: the same update against its floor, the link's time for the "
            "bytes (link s: four raw TCP streams) plus the engines' own update calls loading the weights from "
            "tensors already in their memory (load s), every sampler at once.")
    report(console, f"tpusync in-place weight updates (median of {args.reps})", merged(args.out, results),
           columns, args.out, note)


if __name__ == "__main__":
    main()
