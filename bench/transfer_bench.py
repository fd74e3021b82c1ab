#!/usr/bin/env python3
"""Transfer benchmark: two tpusync-sidecars on loopback and on the fabric, against raw TCP and memcpy.

Measured in one run, so results are ratios:
- network pull and push between two sidecars, for each block size and stream count N,
  against N raw TCP streams carrying the same bytes between two processes (bench/rawtcp.cc,
  native, as fast as the kernel allows); CPU seconds per GB of both sidecars beside the raw
  sender's and receiver's. Every frame is authenticated (AEGIS-128X2-MAC tags); the
  `-encrypted` cases run both sidecars with --encrypt, against the same raw streams;
- an engine putting into and getting from its sidecar through the shared-memory pool
  (control socket), against a single-thread memcpy of the same bytes;
- end to end, the KV cache of an 8K-token request shaped like Qwen3-235B (94 layers x
  K,V x 4 KV heads x 128 x bf16 per token): put on host A, pull to host B, get on B.
Prints a table and writes bench/results/transfer.json.
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
from functools import partial
from pathlib import Path

import numpy as np
import rawtcp
from report import RATE_COLUMNS, merged, report, spread, timed
from rich.console import Console

import tpusync
from tpusync.local import sidecars as sidecar
from tpusync.local.sidecars import write_secret

# Run as `python bench/<name>.py`: bench/ is on sys.path (rawtcp, report); the repository
# root goes there too, for harness.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import fabric as fab

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
QWEN3_235B_TOKEN_BYTES = 94 * 2 * 4 * 128 * 2
COLUMNS = RATE_COLUMNS + [("ratio range", "ratio_range", ""), ("cpu s/GB", "cpu_s_per_gb", ".2f"),
                          ("raw cpu s/GB", "baseline_cpu_s_per_gb", ".2f"),
                          ("put s", "put_seconds", ".3f"), ("pull s", "pull_seconds", ".3f"),
                          ("get s", "get_seconds", ".3f"), ("raw TCP s", "raw_tcp_seconds", ".3f"),
                          ("vs raw TCP", "vs_raw_tcp", ".2f"), ("cold s", "cold_seconds", ".3f")]
PARTS = ("network", "encrypted", "shm", "qwen", "fabric")


def median(times: list[float]) -> float:
    return statistics.median(times)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def keys_for(tag: int, n: int) -> np.ndarray:
    k = np.empty((n, 2), np.uint64)
    k[:, 0] = tag
    k[:, 1] = np.arange(n, dtype=np.uint64)
    return k


def row(name: str, nbytes: int, seconds: float, baseline_seconds: float, *, cpu: float | None = None,
        baseline_cpu: float | None = None, baseline: str | None = None,
        paired: list[tuple[float, float]] | None = None) -> dict:
    """ratio = throughput over the baseline's; CPU as seconds per GB moved (None: not measured).
    `paired`: each rep's (seconds, baseline seconds), run one just after the other: their ratios'
    range is the figure's spread on this shared machine."""
    gbps, base = nbytes / seconds / 1e9, nbytes / baseline_seconds / 1e9
    out = {"case": name, "bytes": nbytes, "seconds": seconds, "baseline_seconds": baseline_seconds, "gbps": gbps,
           "baseline_gbps": base, "ratio": gbps / base,
           "load_avg_1m": os.getloadavg()[0]}  # this machine is shared: how busy it was, beside each figure
    if baseline:
        out["baseline"] = baseline
    if paired:
        out |= spread(paired)
    if cpu is not None:
        out["cpu_s_per_gb"] = cpu / (nbytes / 1e9)
    if baseline_cpu is not None:
        out["baseline_cpu_s_per_gb"] = baseline_cpu / (nbytes / 1e9)
    return out


class Pair:
    """Sidecars A (source) and B (destination) with engine clients on their control sockets."""

    def __init__(self, workdir: str, secret_file: str, pool_bytes: int, block: int, streams: int,
                 encrypt: bool = False):
        self.pools = [f"/dev/shm/tpusync-bench-{uuid.uuid4().hex[:8]}" for _ in range(2)]
        self.a, self.b = (
            sidecar.launch(pool_path=p, secret_file=secret_file, dram_bytes=pool_bytes, block_bytes=block,
                           control_socket=os.path.join(workdir, f"{uuid.uuid4().hex[:8]}.sock"), streams=streams,
                           extra=["--encrypt"] if encrypt else [], stderr=subprocess.DEVNULL)
            for p in self.pools
        )
        self.ea = tpusync.KVStore.connect(f"unix://{self.a.control_socket}")
        self.eb = tpusync.KVStore.connect(f"unix://{self.b.control_socket}")

    def close(self) -> None:
        # Drop the engines' mappings too, or the unlinked pools stay in memory until the
        # Pair is collected, while the next Pair allocates its own (4 GiB cases need both gone).
        self.ea.close()
        self.eb.close()
        del self.ea, self.eb
        for s in (self.a, self.b):
            s.stop()
        for p in self.pools:
            if os.path.exists(p):
                os.unlink(p)


def bench_network(workdir, secret_file, total, block, streams_list, reps, encrypt=False) -> list[dict]:
    """Pulls and pushes between two sidecars; each rep is paired with a raw TCP rep of the
    same bytes over as many streams, run just before it, so slow drifts of this shared
    machine's load hit both sides of the ratio alike."""
    n = total // block
    label = f"{block // MIB}m" if block >= MIB else f"{block // KIB}k"
    suffix = "-encrypted" if encrypt else ""
    src = np.ones(total, np.uint8)
    bufs = [src[i * block:(i + 1) * block] for i in range(n)]
    out = []
    for streams in streams_list:
        pair = Pair(workdir, secret_file, total + 64 * block, block, streams, encrypt)
        try:
            keys = keys_for(1, n)
            pair.ea.put(keys, bufs)
            pulls, pushes, cpus, raws = [], [], [], []
            pids = [pair.a.process.pid, pair.b.process.pid]
            for _ in range(reps):
                raws.append(rawtcp.run(total, streams, 1))
                cpu0, t0 = cpu_seconds(pids), time.perf_counter()
                held = pair.eb.read_remote(pair.a.address, keys)
                pulls.append(time.perf_counter() - t0)
                cpus.append(cpu_seconds(pids) - cpu0)
                assert all(held)
                pair.eb.evict(keys)  # no disk tier: dropped, so the next rep moves everything again
            pair.eb.put(keys_for(2, n), bufs)
            for _r in range(reps):
                raws.append(rawtcp.run(total, streams, 1))
                t0 = time.perf_counter()
                stored = pair.eb.push_remote(pair.a.address, keys_for(2, n))
                pushes.append(time.perf_counter() - t0)
                assert all(stored)
                pair.ea.evict(keys_for(2, n))
            raw_pull, raw_push = raws[:reps], raws[reps:]
            base = f"raw-tcp-{streams}s"
            out.append(row(f"pull-{label}-{streams}s-{total // GIB}g{suffix}", total, median(pulls),
                           median([r.seconds for r in raw_pull]), cpu=median(cpus),
                           baseline_cpu=median([r.cpu_seconds for r in raw_pull]), baseline=base,
                           paired=[(t, r.seconds) for t, r in zip(pulls, raw_pull)]))
            out.append(row(f"push-{label}-{streams}s-{total // GIB}g{suffix}", total, median(pushes),
                           median([r.seconds for r in raw_push]), baseline=base,
                           paired=[(t, r.seconds) for t, r in zip(pushes, raw_push)]))
        finally:
            pair.close()
    return out


def bench_shm(workdir, secret_file, total, block, reps) -> list[dict]:
    n = total // block
    src, dst = np.ones(total, np.uint8), np.full(total, 2, np.uint8)
    bufs = [src[i * block:(i + 1) * block] for i in range(n)]
    outs = [dst[i * block:(i + 1) * block] for i in range(n)]
    pair = Pair(workdir, secret_file, total + 64 * block, block, 1)
    try:
        puts, gets, memcpys = [], [], []
        # An untimed round over every slot of the pool: the engine's first touch of its pages.
        warm = keys_for(9, n + 64)
        pair.ea.put(warm, bufs + bufs[:64])
        pair.ea.evict(warm)
        for r in range(reps):  # each rep's memcpy just before its put and get
            memcpys.append(timed(lambda: np.copyto(dst, src)))
            keys = keys_for(10 + r, n)
            puts.append(timed(partial(pair.ea.put, keys, bufs)))
            dst.fill(2)
            gets.append(timed(partial(pair.ea.get, keys, outs)))
            assert np.array_equal(src, dst)
            pair.ea.evict(keys)
    finally:
        pair.close()
    label = f"{block // MIB}m"
    memcpy = median(memcpys)
    return [row(f"shm-put-{label}", total, median(puts), memcpy, baseline="memcpy-1-thread",
                paired=list(zip(puts, memcpys))),
            row(f"shm-get-{label}", total, median(gets), memcpy, baseline="memcpy-1-thread",
                paired=list(zip(gets, memcpys)))]


def bench_qwen(workdir, secret_file, tokens, block, streams, reps) -> dict:
    """Put on A, pull A -> B, get on B, each phase timed, against the same work done physically:
    a memcpy into a buffer, N raw TCP streams, a memcpy out, measured in the same run.

    Sidecars and engines live long and reuse their pools, so the timed rounds follow one
    untimed round: the engines' first touch of their freshly mapped pool pages (page faults,
    which the raw baseline's pre-faulted buffers never pay) is reported apart, as cold_seconds."""
    nbytes = tokens * QWEN3_235B_TOKEN_BYTES
    n = -(-nbytes // block)
    kv = np.random.default_rng(0).integers(0, 256, n * block, dtype=np.uint8)
    got = np.full_like(kv, 1)
    staged = np.full_like(kv, 2)  # the baseline's pre-faulted landing buffers
    bufs = [kv[i * block:(i + 1) * block] for i in range(n)]
    outs = [got[i * block:(i + 1) * block] for i in range(n)]
    pair = Pair(workdir, secret_file, n * block + 64 * block, block, streams)
    phases: list[tuple[float, float, float]] = []
    raws: list[float] = []
    copy_in: list[float] = []
    copy_out: list[float] = []
    try:
        for r in range(reps + 1):
            keys = keys_for(100 + r, n)
            t0 = time.perf_counter()
            pair.ea.put(keys, bufs)  # prefill host: D2H done, into pool
            t1 = time.perf_counter()
            assert all(pair.eb.read_remote(pair.a.address, keys))  # decode host pulls
            t2 = time.perf_counter()
            assert all(pair.eb.get(keys, outs))  # into decode buffers
            t3 = time.perf_counter()
            assert np.array_equal(kv, got)
            got.fill(1)
            pair.ea.evict(keys)
            pair.eb.evict(keys)
            phases.append((t1 - t0, t2 - t1, t3 - t2))
            if r == 0:
                continue  # the cold round
            copy_in.append(timed(lambda: np.copyto(staged, kv)))
            raws.append(rawtcp.run(nbytes, streams, 1).seconds)
            copy_out.append(timed(lambda: np.copyto(got, staged)))
    finally:
        pair.close()
    put, pull, get = (median([p[i] for p in phases[1:]]) for i in range(3))
    seconds = median([sum(p) for p in phases[1:]])
    raw = median(raws)
    physical = median([a + b + c for a, b, c in zip(copy_in, raws, copy_out)])
    out = row(f"qwen3-235b-{tokens // 1024}k-tokens-e2e", nbytes, seconds, physical,
              baseline=f"memcpy + raw-tcp-{streams}s + memcpy")
    out |= {"put_seconds": put, "pull_seconds": pull, "get_seconds": get, "cold_seconds": sum(phases[0]),
            "raw_tcp_seconds": raw, "vs_raw_tcp": raw / seconds, "pull_vs_raw_tcp": raw / pull,
            "memcpy_seconds": median(copy_in)}
    return out


def bench_fabric(secret_file, profile: fab.Profile, total: int, block: int, streams_list, reps) -> list[dict]:
    """A pull from host h0 to host h1 over one shaped link, against raw TCP over the same link."""
    out = []
    with fab.Fabric(2, profile) as f:
        src_host, dst_host = f.hosts
        for streams in streams_list:
            raw = rawtcp.run(total, streams, reps, bind_ip=dst_host.ip, recv_popen=dst_host.popen,
                             send_popen=src_host.popen)
            port = fab.DATA_PORT + 10 * streams
            a, b = (h.sidecar(secret_file=secret_file, dram_bytes=total + 64 * block, block_bytes=block,
                              streams=streams, data_port=port, http_port=port + 1) for h in (src_host, dst_host))
            ea, eb = (tpusync.KVStore.connect(f"unix://{c.control_socket}") for c in (a, b))
            n = total // block
            src = np.ones(total, np.uint8)
            keys = keys_for(3, n)
            ea.put(keys, [src[i * block:(i + 1) * block] for i in range(n)])
            pulls = []
            before = dst_host.counters().rx_bytes
            for _ in range(reps):
                t0 = time.perf_counter()
                assert all(eb.read_remote(a.address, keys))
                pulls.append(time.perf_counter() - t0)
                eb.evict(keys)
            crossed = dst_host.counters().rx_bytes - before
            assert crossed >= reps * total, f"only {crossed} bytes crossed the link"   # the shaped link, not a shortcut
            ea.close()
            eb.close()
            a.kill()
            b.kill()
            r = row(f"fabric-{profile.name}-pull-{block // MIB}m-{streams}s-{total // MIB}m", total, median(pulls),
                    raw.seconds, baseline=f"raw-tcp-{streams}s-same-link")
            r["line_rate_gbps"] = profile.rate_bytes_per_s / 1e9
            out.append(r)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1g", help="comma list of transfer sizes in GiB, e.g. 1g,4g")
    ap.add_argument("--block-sizes", default="256k,2m,16m")
    ap.add_argument("--streams", default="1,2,3,4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fabric-profiles", default="dc,cross-zone", help="comma list of fabric profiles; '' for none")
    ap.add_argument("--fabric-mib", type=int, default=128)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma list of parts to run, of {','.join(PARTS)}")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "transfer.json"))
    args = ap.parse_args()
    console = Console(width=200)
    sizes = [int(s.rstrip("g")) * GIB for s in args.sizes.split(",")]
    blocks = [int(b[:-1]) * (MIB if b.endswith("m") else KIB) for b in args.block_sizes.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    only = set(args.only.split(","))
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as workdir, console.status("benchmarking") as status:
        secret_file = os.path.join(workdir, "secret")
        write_secret(secret_file, os.urandom(32).hex().encode())
        for total in sizes if "network" in only else []:
            for n in streams:
                status.update(f"raw TCP, {total // GIB} GiB, {n} streams")
                raw = rawtcp.run(total, n, args.reps)
                results.append(row(f"raw-tcp-{n}s-{total // GIB}g", total, raw.seconds, raw.seconds,
                                   cpu=raw.cpu_seconds, baseline_cpu=raw.cpu_seconds, baseline=f"raw-tcp-{n}s"))
            for block in blocks:
                status.update(f"sidecar to sidecar, {total // GIB} GiB in {block // KIB} KiB blocks")
                results += bench_network(workdir, secret_file, total, block, streams, args.reps)
        for total in sizes if "encrypted" in only else []:
            status.update(f"encrypted sessions, {total // GIB} GiB in 2 MiB blocks")
            results += bench_network(workdir, secret_file, total, 2 * MIB, sorted({1, max(streams)}), args.reps,
                                     encrypt=True)
        if "shm" in only:
            status.update("engine <-> sidecar through shared memory")
            results += bench_shm(workdir, secret_file, GIB, 2 * MIB, args.reps)
        if "qwen" in only:
            status.update("Qwen3-235B-shaped 8K-token KV cache, end to end")
            results.append(bench_qwen(workdir, secret_file, 8192, 2 * MIB, max(streams), args.reps))
        for name in filter(None, args.fabric_profiles.split(",") if "fabric" in only else []):
            status.update(f"fabric, {name} profile")
            results += bench_fabric(secret_file, fab.PROFILES[name], args.fabric_mib * MIB, 2 * MIB,
                                    sorted({1, max(streams)}), args.reps)

    if only != set(PARTS):
        results = merged(args.out, results)
    report(console, f"tpusync transfer (median of {args.reps}; loopback, {os.cpu_count()} cores)", results,
           COLUMNS, args.out,
           "baselines: N native raw TCP streams of the same bytes for N sidecar streams (pull/push, qwen e2e; "
           "fabric: over the same shaped link), single-thread memcpy (shm); qwen e2e = engine put on A + pull A->B "
           "+ engine get on B against memcpy + raw TCP + memcpy of the same bytes, after one cold round (cold s); "
           "cpu s/GB: both sidecars (raw: sender + receiver)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
