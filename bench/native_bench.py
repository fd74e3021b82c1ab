#!/usr/bin/env python3
"""Native engine benchmark: put/get throughput of the DRAM and disk tiers, and lookup latency.

Every case is measured beside its physical baseline in the same run, so results are ratios:
DRAM put/get against a single-thread memcpy of the same bytes, the disk tier against
sequential O_DIRECT pwrite/pread of the same bytes in the same block size, one request in flight,
into a freshly fallocated file each repetition as the tier writes one (the tier runs its default
two write-behind threads: while one writes, the other checksums the next block; reads are one
at a time). Prints a table and writes bench/results/native.json.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from report import RATE_COLUMNS, report, spread, timed
from rich.console import Console

import tpusync

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
LOOKUP_KEYS = 10_000
LOOKUP_TARGET_S = 0.002


def median_time(fn, reps: int) -> float:
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def keys_for(run: int, n: int) -> np.ndarray:
    """n distinct 128-bit keys for one repetition, as the (n, 2) uint64 fast path."""
    k = np.empty((n, 2), dtype=np.uint64)
    k[:, 0] = run + 1
    k[:, 1] = np.arange(n, dtype=np.uint64)
    return k


def filled(nbytes: int) -> np.ndarray:
    a = np.empty(nbytes // 8, dtype=np.uint64)
    a[:] = np.arange(a.size, dtype=np.uint64)  # touches every page: no first-fault cost later
    return a.view(np.uint8)


def odirect_gbps(path: str, total: int, block: int, reps: int) -> tuple[float, float]:
    """Sequential O_DIRECT pwrite then pread of `total` bytes in `block`-sized requests.

    Each repetition writes a freshly fallocated file, as the disk tier does (a new directory
    per repetition): the first write into fallocated space converts unwritten extents, which
    here costs a quarter to a third of the rate of rewriting the same blocks in place."""
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(b"\xa5" * block)
    n = total // block
    write_s, read_s = [], []
    for _ in range(reps):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.posix_fallocate(fd, 0, total)
            t0 = time.perf_counter()
            for i in range(n):
                os.pwrite(fd, buf, i * block)
            write_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(n):
                os.preadv(fd, [buf], i * block)
            read_s.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
            os.unlink(path)
    return total / statistics.median(write_s) / 1e9, total / statistics.median(read_s) / 1e9


def case(name: str, nbytes: int, seconds: float, baseline_gbps: float | None,
         paired: list[tuple[float, float]] | None = None) -> dict:
    """`paired`: each rep's (seconds, baseline seconds), run one just after the other."""
    gbps = nbytes / seconds / 1e9 if nbytes else None
    ratio = gbps / baseline_gbps if gbps and baseline_gbps else None
    out = {"case": name, "bytes": nbytes, "seconds": seconds, "gbps": gbps,
           "baseline_gbps": baseline_gbps, "ratio": ratio}
    if paired:
        out |= spread(paired)
    return out


def bench_block_size(block: int, total: int, scratch: str, reps: int) -> list[dict]:
    n = total // block
    src, dst = filled(total), filled(total)
    srcs = [src[i * block:(i + 1) * block] for i in range(n)]
    dsts = [dst[i * block:(i + 1) * block] for i in range(n)]
    label = f"{block // MIB}m" if block >= MIB else f"{block // KIB}k"
    cases = []

    # Each rep: a memcpy of the same bytes, then the put, then the get, so this shared machine's
    # drifts hit the baseline and the case alike.
    memcpys, puts, gets = [], [], []
    with tpusync.KVStore.local(dram_bytes=total, block_bytes=block) as s:
        for r in range(reps):
            memcpys.append(timed(lambda: np.copyto(dst, src)))
            puts.append(timed(lambda r=r: s.put(keys_for(r, n), srcs)))
            dst.fill(0)
            gets.append(timed(lambda r=r: s.get(keys_for(r, n), dsts)))
            assert np.array_equal(src, dst), "DRAM get returned other bytes"
    base_mem = total / statistics.median(memcpys) / 1e9
    cases += [case(f"dram-put-{label}", total, statistics.median(puts), base_mem, list(zip(puts, memcpys))),
              case(f"dram-get-{label}", total, statistics.median(gets), base_mem, list(zip(gets, memcpys)))]

    base_w, base_r = odirect_gbps(os.path.join(scratch, "baseline.dat"), total, block, reps)
    small_dram = max(64 * MIB, 8 * block)

    def disk_put(r: int) -> None:
        # A DRAM pool of 1/16 of the data: nearly every byte leaves through write-behind;
        # the rest is evicted at the end, so the whole GiB is on disk when the clock stops.
        d = os.path.join(scratch, f"put-{r}")
        with tpusync.KVStore.local(dram_bytes=small_dram, block_bytes=block, disk_dir=d, disk_bytes=total) as s:
            keys = keys_for(r, n)
            t0 = time.perf_counter()
            s.put(keys, srcs)
            s.flush()
            s.evict(keys[s.lookup(keys).tiers != tpusync.Tier.DISK])
            times.append(time.perf_counter() - t0)
            assert s.stats()["disk_used"] == n

    times: list[float] = []
    for r in range(reps):
        disk_put(r)
    t_dput = statistics.median(times)

    def disk_get(r: int) -> None:
        # A fresh process view: new DRAM pool, the disk tier written by disk_put above.
        with tpusync.KVStore.local(dram_bytes=small_dram, block_bytes=block,
                                   disk_dir=os.path.join(scratch, f"put-{r}"), disk_bytes=total) as s:
            dst[:] = 0
            t0 = time.perf_counter()
            found = s.get(keys_for(r, n), dsts)
            times.append(time.perf_counter() - t0)
            assert all(found) and np.array_equal(src, dst), "disk get returned other bytes"

    times = []
    for r in range(reps):
        disk_get(r)
        shutil.rmtree(os.path.join(scratch, f"put-{r}"))
    t_dget = statistics.median(times)
    cases += [case(f"disk-put-{label}", total, t_dput, base_w), case(f"disk-get-{label}", total, t_dget, base_r)]
    return cases


def bench_lookup(reps: int = 50) -> list[dict]:
    block = 4096
    with tpusync.KVStore.local(dram_bytes=LOOKUP_KEYS * block, block_bytes=block) as s:
        keys = keys_for(0, LOOKUP_KEYS)
        payload = [np.full(block, 1, dtype=np.uint8)] * LOOKUP_KEYS
        s.put(keys, payload)
        as_ints = [(1 << 64) | i for i in range(LOOKUP_KEYS)]
        out = []
        for name, k in (("lookup-10k-array", keys), ("lookup-10k-ints", as_ints)):
            assert s.lookup(k).prefix_len == LOOKUP_KEYS
            t = median_time(lambda _, k=k: s.lookup(k), reps)
            out.append({"case": name, "bytes": 0, "seconds": t, "gbps": None,
                        "baseline_gbps": None, "ratio": t / LOOKUP_TARGET_S})
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=GIB, help="bytes moved per case (default 1 GiB)")
    ap.add_argument("--block-sizes", default="256k,2m,16m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--scratch", default="/var/tmp", help="directory for the disk tier (a real disk)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "native.json"))
    args = ap.parse_args()

    console = Console()
    sizes = [int(s[:-1]) * (MIB if s.endswith("m") else KIB) for s in args.block_sizes.split(",")]
    scratch = tempfile.mkdtemp(prefix="tpusync-bench-", dir=args.scratch)
    results: list[dict] = []
    try:
        with console.status("benchmarking") as status:
            for block in sizes:
                status.update(f"block size {block // KIB} KiB")
                results += bench_block_size(block, args.bytes, scratch, args.reps)
            status.update("lookup")
            results += bench_lookup()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    report(console, f"tpusync native engine ({args.bytes / GIB:g} GiB per case, median of {args.reps})", results,
           [*RATE_COLUMNS, ("ratio range", "ratio_range", "")], args.out,
           "baselines: single-thread memcpy (dram-*), O_DIRECT pwrite/pread of the same block size "
           f"(disk-*); lookup ratio = seconds / {LOOKUP_TARGET_S * 1e3:g} ms target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
