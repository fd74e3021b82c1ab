#!/usr/bin/env python3
"""Generates docs/performance.md and its plots from bench/results/*.json.

Prose here says what each benchmark measures and never quotes a figure: every number in the
document comes from the JSON files the benchmarks wrote, so the two cannot drift apart.
`make bench` runs every benchmark and then this script (in a small cached environment with
matplotlib: `make performance-doc`).

    python bench/performance_doc.py [--results bench/results] [--out docs/performance.md]
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (result key, header, format); the columns of a table are those its rows have, in this order.
COLUMNS = [
    ("case", "case", ""), ("tokens", "tokens", "d"), ("bytes", "MiB", "mib"), ("seconds", "s", ".3f"),
    ("baseline_seconds", "baseline s", ".3f"), ("gbps", "GB/s", ".2f"), ("baseline_gbps", "baseline GB/s", ".2f"),
    ("ratio", "ratio", ".2f"), ("ratio_range", "ratio range (per rep)", ""), ("reps", "reps", "d"),
    ("baseline", "baseline", ""), ("line_rate_gbps", "line rate GB/s", ".3f"),
    ("vs_line_rate", "vs line rate", ".2f"), ("floor_seconds", "floor s", ".3f"), ("vs_floor", "vs floor", ".2f"),
    ("cores_busy", "cores busy", ".2f"), ("cpu_s_per_gb", "CPU s/GB", ".2f"),
    ("baseline_cpu_s_per_gb", "baseline CPU s/GB", ".2f"), ("raw_cpu_s_per_gb", "raw TCP CPU s/GB", ".2f"),
    ("cpu_vs_raw", "CPU vs raw", ".2f"), ("put_seconds", "put s", ".3f"), ("pull_seconds", "pull s", ".3f"),
    ("get_seconds", "get s", ".3f"), ("raw_tcp_seconds", "raw TCP s", ".3f"), ("vs_raw_tcp", "vs raw TCP", ".2f"),
    ("cold_seconds", "cold s", ".3f"), ("pull_vs_raw_tcp", "pull vs raw TCP", ".2f"),
    ("memcpy_seconds", "memcpy s", ".3f"), ("min_seconds", "min s", ".4f"), ("max_seconds", "max s", ".4f"),
    ("scan_interval_s", "scan s", ".1f"),
    # routing
    ("requests", "requests", "d"), ("prompt_tokens", "prompt tokens", "d"),
    ("prefix_hit_rate", "prefix hit rate", ".1%"),
    ("computed_tokens", "computed tokens", "d"), ("recomputed_tokens", "recomputed tokens", "d"),
    ("recomputed_vs_random", "recomputed vs random", ".3f"), ("ttft_p50_s", "TTFT p50 s", ".4f"),
    ("ttft_p90_s", "TTFT p90 s", ".4f"), ("ttft_p50_vs_recompute", "TTFT p50 vs recompute", ".2f"),
    ("load_avg_1m", "load avg", ".1f"),
    # where the time goes (profile): CPU seconds per GB in each bucket
    ("kernel_copy_cpu_s_per_gb", "kernel copy", ".3f"), ("kernel_other_cpu_s_per_gb", "kernel other", ".3f"),
    ("aegis_cpu_s_per_gb", "AEGIS", ".3f"), ("libc_copy_cpu_s_per_gb", "libc copy", ".3f"),
    ("tpusync_cpu_s_per_gb", "tpusync", ".3f"), ("other_cpu_s_per_gb", "other", ".3f"),
    ("idle_cpu_s_per_gb", "idle", ".3f"), ("busy_cpu_s_per_gb", "busy", ".3f"), ("wall_s_per_gb", "wall s/GB", ".3f"),
]

PROFILE_PROSE = (
    "Each loopback path of the table above, and its baseline, run again under `perf record -a` (both "
    "cores, 1 kHz): every sample goes to one bucket, shown as CPU seconds per GB moved; idle is what the "
    "timed reps left of the two cores. Raw TCP is the difference between a run of 16 reps and one of 8, "
    "each in one pair of processes, so their start and their buffers' first touch cancel out. Both ends of a "
    "loopback transfer share these two cores, so a CPU second either end spends beyond the baseline's is a "
    "second the other end waits for. What it shows: the kernel spends on a pull about what it spends on raw "
    "TCP of the same bytes (its copies to and from the socket buffers, its TCP stack), a little more with "
    "256 KiB blocks (more frames: more reads, writes and wake-ups); the sidecars' own code (framing, the "
    "store) is 0.005-0.02 CPU s/GB; the frames' tags, AEGIS-128X2-MAC over every byte on both ends, "
    "0.07-0.08 (0.23 with --encrypt's AEGIS-128X2, which writes the ciphertext to a buffer before the "
    "socket copies it). Wire protocol 2 tagged frames with AES-GCM's GMAC, which on this machine (AMD "
    "EPYC, no AVX-512: intel-ipsec-mb ran GMAC at 4 GB/s a core) cost 0.5 CPU s/GB, as much as the "
    "kernel's whole transfer, and held pulls and pushes of two or more streams to 0.45-0.8 of raw TCP. "
    "From four streams on, both are CPU-bound (idle near 0), so time per GB is busy CPU over the two cores, "
    "and an authenticated pull can reach at most raw TCP's busy / (raw TCP's busy + the tags) of raw TCP, "
    "about 0.9 here, whatever the framing. Runs of this table move by 0.05-0.1 CPU s/GB (raw TCP's, a "
    "difference of two runs, the most). On two hosts each end has its own cores and pays half the tags. "
    "The engine's gets through the pool (shm-get, dram-get) spend their time in the streaming copy itself.")

SECTIONS = [
    ("native", "Native engine", "bench/native_bench.py",
     "The DRAM tier (put/get through the shared pool) against a single-thread memcpy of the same bytes, and "
     "the disk tier (write-behind put, read-ahead get with verification) against O_DIRECT pwrite/pread, one "
     "request in flight, into a freshly fallocated file as the tier writes one; lookups of 10,000 keys in "
     "milliseconds (ratio: against the 2 ms target). DRAM can beat "
     "memcpy because the engine's copy uses streaming stores that do not depend on alignment (docs/native.md). "
     "The disk put case streams the bytes through a smaller DRAM pool; all of them are on disk when the clock "
     "stops."),
    ("transfer", "Transfer", "bench/transfer_bench.py",
     "Two sidecars on loopback: a pull (the destination asks) and a push of the same bytes, for each block "
     "size and stream count N, against N native raw TCP streams (bench/rawtcp.cc) in the same run; CPU seconds "
     "per GB of both sidecars beside the raw sender's and receiver's. shm-*: an engine's put/get through the "
     "shared pool against memcpy. qwen3-235b-*: the KV cache of an 8K-token request shaped like Qwen3-235B, "
     "put on host A, pulled to B, read out on B, each phase timed, against the same bytes memcpy'd in, sent over "
     "N raw TCP streams and memcpy'd out in the same run (vs raw TCP: against the raw streams alone); the "
     "timed rounds follow one cold round whose engine-side first touch of the pool pages is shown as cold s. "
     "fabric-*: a pull between two simulated hosts over one shaped "
     "link (harness/fabric.py) against raw TCP over the same link; dc is 1 Gbit/s with a 100 us RTT, "
     "cross-zone a 2 ms RTT with scaled-down socket buffers, where one stream is window-limited."),
    ("profile", "Where the transfer time goes", "bench/profile_bench.py (make profile)", PROFILE_PROSE),
    ("serving", "Serving", "bench/serving_bench.py, bench/multihost_bench.py",
     "Time to first token with a prefix hit from DRAM, from disk and from a peer, against recomputing the "
     "whole prompt; pd-transfer: the P/D KV transfer against the prefill compute. The reference model is small, "
     "so its KV per token is small next to its compute: the ratios say how little of TTFT tpusync adds, not "
     "what a 235B model would see. pd-singlehost, pd-multihost, pd-hetero-tp2-tp4: reference engines on "
     "simulated hosts (the dc fabric, 1 Gbit/s per host), the same prompt bytes each time, between one-host "
     "engines, between slices of two hosts (each decode host pulling its half of every page from its "
     "counterpart), and from a slice of tensor parallelism 2 to one of 4 (each decode host pulling the parts its "
     "heads overlap): ratio = the slowest decode host's transfer / one host's share of the bytes at line rate."),
    ("shared", "Shared tier", "bench/shared_bench.py",
     "put: blocks stored through a store with a write-through shared tier (DRAM copy, AES-GMAC tags under "
     "keys derived from the pool secret, O_DIRECT write to a temporary name, rename) until flushed; get: the "
     "same blocks read by a fresh store on the directory "
     "(verified, promoted into DRAM, copied out); both against the same number of files of the same sizes "
     "written and read with plain O_DIRECT syscalls in the same run (ratio = raw time / tier time). hit: the "
     "reference engine on a fresh host (empty DRAM, no disk, no peer) serving a prompt another host stored, "
     "against that host recomputing it (ratio = TTFT / recompute TTFT); the engine is configured for 128K "
     "tokens there, which makes its recompute slower than in the serving table. Both sides write, then both "
     "read, the side that goes first alternating by repetition (a read right after its own writes finds this "
     "virtual disk's cache warmer), and both read into memory touched before the clock starts (the stores' "
     "pools locked, as a running sidecar's are once used): earlier runs without that measured the page "
     "faults of fresh pools and arrays, and gets of 0.3 to 0.9. The tags' cost (issue 41), 2 MiB blocks, the "
     "code before and after in 10 rounds of alternating order: tier time after / before, median 0.995 for "
     "put (0.87-1.10) and 0.961 for get (0.87-1.18): within this disk's noise."),
    ("weight_sync", "Weight synchronization", "bench/weight_sync_bench.py, bench/inplace_bench.py",
     "inplace-*: a random Qwen3 (float32) published by a torch trainer, one copy pushed to the samplers' host, "
     "and every engine there (two vLLM engines; one tpu-inference engine) serving it, updated in place, against "
     "an engine of the same kind started from the checkpoint; naive-vllm: each sampler on a host of its own, "
     "pulling its own copy (against inplace); link-raw: four raw TCP streams of the version's bytes; "
     "inplace-*-floor: the same update against its floor, the link's time for the bytes plus the engines' own "
     "update calls loading them from tensors already in their memory (harness/load_floor.py), every engine "
     "at once. "
     "Loopback cases: samplers on one host sharing its copy, a chain of hops, and a naive fan-out, each "
     "against its one-host or one-hop case; tcp-raw: four native raw TCP streams of the same bytes. "
     "fabric-* cases run on simulated hosts, one network namespace each with its own shaped link, so hops no "
     "longer share a loopback: ratio = seconds over one fabric hop of the same bytes (fabric-hop-1), "
     "vs line rate = seconds over the bytes at the link's line rate. hop-vs-pull-*: ratio = a hop's "
     "throughput over a plain sidecar pull's of the same bytes. Every case is the median of its runs. On "
     "loopback every simulated host shares the same cores, so a chain's hops compete instead of overlapping "
     "(cores busy: CPU seconds of every sidecar and the executor per wall second). A fan-out-2 tree puts two "
     "copies on each relay's uplink, so its floor is twice the line-rate time of the bytes plus the pipeline "
     "fill (a chunk per level below the first, at half the line rate); a naive fan-out puts one copy per host on "
     "the trainer's uplink. floor s: that link-limited time from the plan's model (plan.predict), vs floor: the "
     "measured time over it."),
    ("routing", "Routing by prefix", "bench/routing_bench.py",
     "Reference servers with real sidecars under a shared-prefix multi-turn workload (system prompts shared by "
     "many users, conversations that come back turn after turn), one request at a time. recompute: no prefix "
     "cache, every prompt computed in full (the physical baseline). random: the server picked uniformly. "
     "precise: the server llm-d's own indexer (llm-d-kv-cache v0.9.0, wired as the router's precise "
     "prefix-cache producer, tests/llmd/indexer) scores first, fed by the engines' KV events for the blocks "
     "their sidecars hold in DRAM and on disk. precise-unannounced: the same indexer without events for the "
     "DRAM/disk tiers (upstream TPU Sync publishes none for offloaded blocks), so it routes blind. Prefix hit "
     "rate: prompt tokens loaded instead of computed. Recomputed tokens: computed tokens minus those no server "
     "had seen before (the novel part of each prompt, in whole pages); recomputed vs random is the target's "
     "ratio."),
    ("router_lag", "The router's view of the tiers", "bench/router_lag_bench.py",
     "How long llm-d's own indexer (v0.9.0) keeps a stale view of a pod after its sidecar's tiers change, "
     "polled every 2 ms, with reference engines on real sidecars and no timed audit: announce, a request's "
     "blocks after it returns (the baseline of the same kind: the engine's own announcement, same socket and "
     "indexer); demote and evict, store.evict on the sidecar (DRAM to disk, disk to gone) until the index says "
     "so; shared-publish and shared-evict, a block another host put on or removed from the shared tier until "
     "this pod is scored for it or not, which waits for this pod's sidecar to scan the tier (scan s; 10 s by "
     "default). ratio = lag / announce lag."),
    ("device", "On an accelerator", "bench/device_check.py (bench/device/run.sh on a lent GPU)",
     "tpusync's JAX page paths with the cache in an accelerator's memory. d2h-jax: device -> pool "
     "(save_pages), h2d-jax: pool -> device (load_pages), blocks of 64 KiB to 64 MiB, contiguous (a block is "
     "one layer's page) or layer-strided (the pages of 8 layers), each rep beside the framework's own copy of "
     "the same bytes: JAX's device_put into and out of its pinned_host memory. pd-qwen3-235b-8k: the KV cache of "
     "an 8K-token Qwen3-235B request device -> pool A -> pull -> pool B -> device, against copy out + 4 raw TCP "
     "streams + copy in. pd-reference: make demo's P/D with its model servers on the device (tokens equal to "
     "monolithic serving, then a prefix hit). tpusync's JAX copies stage through pageable host buffers of "
     "their own; dma-map-jax says whether the device's PJRT client could DMA-map the pool itself (jaxlib's "
     "Client.dma_map) and spare the staging. d2h-torch, h2d-torch: the same for a "
     "torch paged cache (tpusync.kv.torch_pages) against torch's pin_memory copies, the pool registered with "
     "CUDA (cudaHostRegister) and, -pageable, not. stall-torch-unpaced, -paced: matmul kernels on the compute "
     "stream while a 1 GiB load from the pool runs on a side stream, whole or paced (16 MiB chunks, 64 MiB in "
     "flight); ratio = the kernels' median time alone over beside the load (1: untouched), with the longest "
     "kernel beside it: whether loads are paced by default is decided on these."),
    ("operator", "Operator", "bench/operator_bench.py",
     "One TPUSyncPool and N DisaggregatedServing objects on the e2e control plane, everything on the same "
     "cores: time until all are Ready, reconcile latencies, the operator's CPU and memory. A pass's wall time "
     "is mostly waiting on an API server that shares the cores. The baseline, in the same run: the same "
     "servings' objects as the operator renders them, applied server-side with no operator, until every "
     "Deployment is available; ratio = the operator's all-Ready time over that."),
]

# Sections shown even without results: what they are waiting for.
NOT_RUN = {"device": "Not run on an accelerator yet: no session has been lent a GPU since the check was written "
                     "(issue 45). make test runs its steps on the CPU with CPU arrays; README, \"On a GPU\", says how "
                     "to run it on one."}

PLOTS = "performance"  # folder next to the document


def load(results: Path) -> dict[str, list[dict]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}


def fmt(value, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "mib":
        return f"{value / (1 << 20):.0f}"
    if isinstance(value, float) and not spec:
        return f"{value:.3g}"
    if isinstance(value, list):  # per-run figures: the spread is ratio_min..ratio_max beside them
        return f"{len(value)} runs"
    return format(value, spec)


def table(rows: list[dict]) -> str:
    keys = {k for r in rows for k in r}
    if "ratio_range" in keys:  # the range says both ends
        keys -= {"ratio_min", "ratio_max"}
    cols = [c for c in COLUMNS if c[0] in keys] + [(k, k, "") for k in sorted(keys - {c[0] for c in COLUMNS})]
    out = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + " --- |" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(k), spec) for k, _, spec in cols) + " |" for r in rows]
    return "\n".join(out)


def cases(res: dict, file: str, pattern: str) -> list[dict]:
    return [r for r in res.get(file, []) if re.fullmatch(pattern, r["case"])]


Target = tuple[str, str, str]  # (target, measured, met)


def targets(res: dict) -> list[Target]:
    """Each target the project set, checked against the recorded results (skipped when absent)."""
    out: list[Target] = []

    def check(name: str, rows: list[dict], ok: Callable[[dict], bool], show: Callable[[dict], str]) -> None:
        if rows:
            missed = [r for r in rows if not ok(r)]
            verdict = "met" if not missed else f"**not met** ({len(missed)} of {len(rows)})"
            shown = rows if len(rows) <= 4 else missed[:4]  # many cases: the misses only
            measured = "; ".join(f"{r['case']}: {show(r)}" for r in shown)
            if len(shown) < len(rows):
                unshown_misses = len(missed) - len(shown) if missed else 0
                more = f"{unshown_misses} more not met, " if unshown_misses else ""
                measured += f"{'; ' if shown else ''}({more}{len(rows) - len(missed)} met: see the tables)"
            out.append((name, measured, verdict))

    ratio = lambda r: f"{r['ratio']:.2f}"  # noqa: E731
    check("loopback pull and push >= 0.9 x N raw TCP streams (the median of its reps)",
          cases(res, "transfer", r"(pull|push)-\d+[km]-\ds-\d+g"), lambda r: r["ratio"] >= 0.9, ratio)
    check("encrypted pull and push >= 0.85 x N raw TCP streams",
          cases(res, "transfer", r"(pull|push)-.*-encrypted"), lambda r: r["ratio"] >= 0.85, ratio)
    check("DRAM tier and engine <-> sidecar gets >= 0.9 x memcpy",
          cases(res, "native", r"dram-get-.*") + cases(res, "transfer", r"shm-get-.*"),
          lambda r: r["ratio"] >= 0.9, ratio)
    check("engine <-> sidecar puts through the pool >= 0.8 x memcpy", cases(res, "transfer", r"shm-put-.*"),
          lambda r: r["ratio"] >= 0.8, ratio)
    check("disk tier writes >= 0.7 x O_DIRECT (2 MiB, 16 MiB blocks)", cases(res, "native", r"disk-put-(2m|16m)"),
          lambda r: r["ratio"] >= 0.7, ratio)
    check("full-prefix DRAM hit at 8K tokens <= 0.15 x recompute", cases(res, "serving", r"prefix-hit-dram-8k"),
          lambda r: r["ratio"] <= 0.15, ratio)
    check("P/D transfer <= 0.1 x prefill", cases(res, "serving", r"pd-transfer-.*"), lambda r: r["ratio"] <= 0.1, ratio)
    check("multi-host and heterogeneous P/D: the hosts' pulls in parallel, <= 1.2 x one host's share at line rate",
          cases(res, "serving", r"pd-(multihost|hetero-.*)-\d+k"), lambda r: r["ratio"] <= 1.2, ratio)
    check("shared tier put and get >= 0.8 x the raw filesystem", cases(res, "shared", r"shared-(put|get)-.*"),
          lambda r: r["ratio"] >= 0.8, ratio)
    check("a 64K-token prefix from the shared tier on a fresh host <= 0.15 x recompute",
          cases(res, "shared", r"shared-hit-64k"), lambda r: r["ratio"] <= 0.15, ratio)
    secs = lambda r: f"{r['ratio']:.2f} ({r['seconds']:.2f} s vs {r['baseline_seconds']:.2f} s)"  # noqa: E731
    check("fabric chain over 4 hosts: every run <= 1.3 x one hop, the median <= 1.15 x",
          cases(res, "weight_sync", r"fabric-chain-4-.*"),
          lambda r: r["ratio"] <= 1.15 and len(r.get("ratio_runs", ())) >= 5 and r["ratio_max"] <= 1.3,
          lambda r: f"median {secs(r)}, runs {r['ratio_min']:.2f}-{r['ratio_max']:.2f} "
                    f"over {len(r['ratio_runs'])}" if "ratio_runs" in r else secs(r))
    check("fabric tree over 8 hosts <= 2 x one hop", cases(res, "weight_sync", r"fabric-tree-8-.*"),
          lambda r: r["ratio"] <= 2.0, secs)
    check("fabric naive fan-out to N hosts ~ N x one hop (within 25 %)",
          cases(res, "weight_sync", r"fabric-naive-\d+-.*"),
          lambda r: abs(r["ratio"] / int(r["case"].split("-")[2]) - 1) <= 0.25, secs)
    check("a weight-sync hop >= 0.9 x a plain pull's throughput", cases(res, "weight_sync", r"hop-vs-pull-.*"),
          lambda r: r["ratio"] >= 0.9,
          lambda r: f"{r['ratio']:.2f} ({r['seconds']:.2f} s vs {r['pull_seconds']:.2f} s)")
    check("CPU s/GB of a hop <= 1.3 x raw TCP's", [r for r in cases(res, "weight_sync", r"hop-vs-pull-.*")
                                                  if "cpu_vs_raw" in r],
          lambda r: r["cpu_vs_raw"] <= 1.3,
          lambda r: f"{r['cpu_vs_raw']:.2f} ({r['cpu_s_per_gb']:.2f} vs {r['raw_cpu_s_per_gb']:.2f} CPU s/GB)")
    check("a running engine updated in place <= 0.5 x its reload from the checkpoint",
          cases(res, "weight_sync", r"inplace-(?!.*-floor$).*"), lambda r: r["ratio"] <= 0.5, secs)
    check("an in-place update <= 1.3 x its floor: the link's time for the bytes + the engine's own load of "
          "them from memory", cases(res, "weight_sync", r"inplace-.*-floor"), lambda r: r["ratio"] <= 1.3,
          lambda r: f"{r['ratio']:.2f} ({r['seconds']:.2f} s vs {r['link_seconds']:.2f} s link + "
                    f"{r['load_seconds']:.2f} s load)")
    check("samplers on one host fed from one copy <= 1.1 x one sampler",
          cases(res, "weight_sync", r"onehost-([2-9]|\d\d+)-samplers-.*"), lambda r: r["ratio"] <= 1.1, secs)
    check("device <-> pool through tpusync >= 0.9 x the framework's pinned copy (on an accelerator)",
          [r for r in cases(res, "device", r"(d2h|h2d)-.*") if r.get("device") != "cpu"], lambda r: r["ratio"] >= 0.9,
          lambda r: f"{ratio(r)} on {r['device']}")
    check("a request's KV device -> pool -> peer -> pool -> device >= 0.9 x copy out + raw TCP + copy in",
          [r for r in cases(res, "device", r"pd-qwen3-.*") if r.get("device") != "cpu"], lambda r: r["ratio"] >= 0.9,
          lambda r: f"{ratio(r)} on {r['device']}")
    check("a pod's own demotions and evictions reach llm-d's index within 100 ms",
          cases(res, "router_lag", r"lag-(demote|evict)"), lambda r: r["max_seconds"] <= 0.1,
          lambda r: f"median {r['seconds'] * 1000:.1f} ms, max {r['max_seconds'] * 1000:.1f} ms")
    check("precise routing recomputes <= 0.1 x the tokens random routing does",
          cases(res, "routing", r"precise"), lambda r: r["recomputed_vs_random"] <= 0.1,
          lambda r: f"{r['recomputed_vs_random']:.3f} ({r['recomputed_tokens']} tokens)")
    return out


def plot_transfer(res: dict, out: Path) -> str | None:
    import matplotlib.pyplot as plt

    pulls = [(m, r) for r in res.get("transfer", []) if (m := re.fullmatch(r"pull-(\d+)([km])-(\d+)s-1g", r["case"]))]
    if not pulls:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for streams in sorted({int(m[3]) for m, _ in pulls}):
        pts = sorted((int(m[1]) * (1024 if m[2] == "m" else 1), r["gbps"]) for m, r in pulls if int(m[3]) == streams)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"sidecar pull, {streams} streams")
        raw = cases(res, "transfer", rf"raw-tcp-{streams}s-1g")
        if raw:
            ax.axhline(raw[0]["gbps"], color=line.get_color(), linestyle="--", linewidth=1,
                       label=f"raw TCP, {streams} streams")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    return save(fig, ax, out, "transfer-pull.png", xlabel="block size (KiB)", ylabel="GB/s",
                title="1 GiB pull between two sidecars on loopback vs raw TCP")


def plot_serving(res: dict, out: Path) -> str | None:
    import matplotlib.pyplot as plt

    rows = res.get("serving", [])
    kinds = {"prefix-hit-dram": "DRAM hit", "prefix-hit-disk": "disk hit", "prefix-hit-peer": "peer hit"}
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    base = sorted({(r["tokens"], r["baseline_seconds"]) for r in rows if r["case"].startswith("prefix-hit-dram")})
    ax.plot([t for t, _ in base], [s for _, s in base], marker="o", label="recompute the prompt")
    for prefix, label in kinds.items():
        pts = sorted((r["tokens"], r["seconds"]) for r in rows if r["case"].startswith(prefix))
        ax.plot([t for t, _ in pts], [s for _, s in pts], marker="o", label=label)
    ax.set_yscale("log")
    return save(fig, ax, out, "serving-ttft.png", xlabel="prompt tokens", ylabel="TTFT (s)",
                title="Time to first token: prefix hits vs recompute")


def plot_weights(res: dict, out: Path) -> str | None:
    import matplotlib.pyplot as plt

    hop = cases(res, "weight_sync", r"fabric-hop-1-.*")
    if not hop:
        return None
    tag = hop[0]["case"].removeprefix("fabric-hop-1-")
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind in ("chain", "tree", "naive"):
        pts = sorted((int(r["case"].split("-")[2]), r["seconds"])
                     for r in cases(res, "weight_sync", rf"fabric-{kind}-\d+-{tag}"))
        if pts:
            ax.plot([1] + [n for n, _ in pts], [hop[0]["seconds"]] + [s for _, s in pts], marker="o",
                    label=kind if kind != "tree" else "tree, fan-out 2")
    ax.axhline(hop[0]["seconds"], color="grey", linestyle="--", linewidth=1, label="one hop")
    ax.axhline(hop[0]["line_rate_seconds"], color="black", linestyle=":", linewidth=1, label="bytes at line rate")
    return save(fig, ax, out, "weight-sync-hosts.png", xlabel="destination hosts",
                ylabel="seconds until every host committed", title=f"Weight sync on the simulated fabric ({tag})")


def save(fig, ax, out: Path, name: str, *, xlabel: str, ylabel: str, title: str) -> str:
    """Labels the plot, adds its legend and writes it as out/name; returns its path in the doc."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # No timestamps in the PNG: regenerating from the same JSON gives the same file.
    fig.savefig(out / name, dpi=110, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"{PLOTS}/{name}"


def render(res: dict, doc_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    plots = {"transfer": plot_transfer(res, doc_dir / PLOTS), "serving": plot_serving(res, doc_dir / PLOTS),
             "weight_sync": plot_weights(res, doc_dir / PLOTS)}
    lines = ["# Performance", "",
             "Generated by `bench/performance_doc.py` from `bench/results/*.json`; do not edit by hand. "
             "`make bench` reruns every benchmark and regenerates this page and its plots. Every benchmark "
             "measures its physical baseline in the same run; ratios stand next to absolute seconds. The "
             "figures come from the machine that ran the benchmarks (this project's is a 2-core VM with other "
             "work on it, where single figures move by 10-30 % between runs; `load avg`, where recorded, is the "
             "1-minute load average when the case ended: far above the core count, loopback figures mean little, "
             "while the fabric's, bound by its shaped links, hold).", "",
             "## Targets", "", "| target | measured | |", "| --- | --- | --- |"]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in targets(res)]
    for key, title, script, prose in SECTIONS:
        if key not in res:
            if key in NOT_RUN:
                lines += ["", f"## {title} — `{script}`", "", NOT_RUN[key]]
            continue
        lines += ["", f"## {title} — `{script}`", "", prose, ""]
        if plots.get(key):
            lines += [f"![{title}]({plots[key]})", ""]
        lines.append(table(res[key]))
    for key in sorted(set(res) - {k for k, *_ in SECTIONS}):  # results of benchmarks this script has no notes for
        lines += ["", f"## {key} — `bench/{key}_bench.py`", "", table(res[key])]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(HERE / "results"))
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "performance.md"))
    args = ap.parse_args()
    out = Path(args.out)
    out.write_text(render(load(Path(args.results)), out.parent))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
