#!/usr/bin/env python3
"""Transfer benchmark: two tpusync-sidecars on loopback, against raw TCP and memcpy.

Measured in one run, so results are ratios:
- network pull and push between two sidecars, for each block size and stream count,
  against a raw single-stream TCP socket copy of the same bytes (two processes);
- an engine putting into and getting from its sidecar through the shared-memory pool
  (control socket), against a single-thread memcpy of the same bytes;
- end to end, the KV cache of an 8K-token request shaped like Qwen3-235B (94 layers x
  K,V x 4 KV heads x 128 x bf16 per token): put on host A, pull to host B, get on B.
Prints a table and writes bench/results/transfer.json.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
from rich.console import Console

import tpusync
from report import RATE_COLUMNS, report
from tpusync import sidecar

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
QWEN3_235B_TOKEN_BYTES = 94 * 2 * 4 * 128 * 2

RAW_SENDER = textwrap.dedent(
    """
    import socket, sys
    import numpy as np
    port, total = int(sys.argv[1]), int(sys.argv[2])
    buf = np.ones(total, np.uint8)
    s = socket.create_connection(("127.0.0.1", port))
    for _ in range(int(sys.argv[3])):
        s.sendall(memoryview(buf))
        s.recv(1)
    """
)


def median(times: list[float]) -> float:
    return statistics.median(times)


def raw_tcp_seconds(total: int, reps: int) -> float:
    """One stream, one sender process, 4 MiB recv_into calls: the loopback TCP ceiling."""
    listener = socket.create_server(("127.0.0.1", 0))
    proc = subprocess.Popen([sys.executable, "-c", RAW_SENDER, str(listener.getsockname()[1]), str(total),
                             str(reps)])
    conn, _ = listener.accept()
    sink = memoryview(np.ones(total, np.uint8))  # pre-faulted, like every buffer here
    times = []
    for _ in range(reps):
        got = 0
        t0 = time.perf_counter()
        while got < total:
            got += conn.recv_into(sink[got:got + 4 * MIB])
        times.append(time.perf_counter() - t0)
        conn.sendall(b"k")
    proc.wait()
    conn.close()
    listener.close()
    return median(times)


def keys_for(tag: int, n: int) -> np.ndarray:
    k = np.empty((n, 2), np.uint64)
    k[:, 0] = tag
    k[:, 1] = np.arange(n, dtype=np.uint64)
    return k


def row(name: str, nbytes: int, seconds: float, baseline_seconds: float) -> dict:
    gbps, base = nbytes / seconds / 1e9, nbytes / baseline_seconds / 1e9
    return {"case": name, "bytes": nbytes, "seconds": seconds, "gbps": gbps, "baseline_gbps": base,
            "ratio": gbps / base}


class Pair:
    """Sidecars A (source) and B (destination) with engine clients on their control sockets."""

    def __init__(self, workdir: str, secret_file: str, pool_bytes: int, block: int, streams: int):
        self.pools = [f"/dev/shm/tpusync-bench-{uuid.uuid4().hex[:8]}" for _ in range(2)]
        self.a, self.b = (
            sidecar.launch(pool_path=p, secret_file=secret_file, dram_bytes=pool_bytes, block_bytes=block,
                           control_socket=os.path.join(workdir, f"{uuid.uuid4().hex[:8]}.sock"), streams=streams,
                           stderr=subprocess.DEVNULL)
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


def bench_network(workdir, secret_file, total, block, streams_list, reps, raw_s) -> list[dict]:
    n = total // block
    label = f"{block // MIB}m" if block >= MIB else f"{block // KIB}k"
    src = np.ones(total, np.uint8)
    bufs = [src[i * block:(i + 1) * block] for i in range(n)]
    out = []
    for streams in streams_list:
        pair = Pair(workdir, secret_file, total + 64 * block, block, streams)
        try:
            keys = keys_for(1, n)
            pair.ea.put(keys, bufs)
            pulls, pushes = [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                held = pair.eb.read_remote(pair.a.address, keys)
                pulls.append(time.perf_counter() - t0)
                assert all(held)
                pair.eb.evict(keys)  # no disk tier: dropped, so the next rep moves everything again
            pair.eb.put(keys_for(2, n), bufs)
            for r in range(reps):
                t0 = time.perf_counter()
                stored = pair.eb._native.push_remote(pair.a.address, keys_for(2, n))
                pushes.append(time.perf_counter() - t0)
                assert all(stored)
                pair.ea.evict(keys_for(2, n))
            out.append(row(f"pull-{label}-{streams}s-{total // GIB}g", total, median(pulls), raw_s))
            out.append(row(f"push-{label}-{streams}s-{total // GIB}g", total, median(pushes), raw_s))
        finally:
            pair.close()
    return out


def bench_shm(workdir, secret_file, total, block, reps) -> list[dict]:
    n = total // block
    src, dst = np.ones(total, np.uint8), np.full(total, 2, np.uint8)
    bufs = [src[i * block:(i + 1) * block] for i in range(n)]
    outs = [dst[i * block:(i + 1) * block] for i in range(n)]
    memcpy = median([_timed(lambda: np.copyto(dst, src)) for _ in range(reps)])
    pair = Pair(workdir, secret_file, total + 64 * block, block, 1)
    try:
        puts, gets = [], []
        for r in range(reps):
            keys = keys_for(10 + r, n)
            puts.append(_timed(lambda: pair.ea.put(keys, bufs)))
            gets.append(_timed(lambda: pair.ea.get(keys, outs)))
            assert np.array_equal(src, dst)
            pair.ea.evict(keys)
    finally:
        pair.close()
    label = f"{block // MIB}m"
    return [row(f"shm-put-{label}", total, median(puts), memcpy), row(f"shm-get-{label}", total, median(gets), memcpy)]


def bench_qwen(workdir, secret_file, tokens, block, streams, raw_s) -> dict:
    nbytes = tokens * QWEN3_235B_TOKEN_BYTES
    n = -(-nbytes // block)
    kv = np.random.default_rng(0).integers(0, 256, n * block, dtype=np.uint8)
    got = np.full_like(kv, 1)
    pair = Pair(workdir, secret_file, n * block + 64 * block, block, streams)
    try:
        keys = keys_for(7, n)
        t0 = time.perf_counter()
        pair.ea.put(keys, [kv[i * block:(i + 1) * block] for i in range(n)])  # prefill host: D2H done, into pool
        assert all(pair.eb.read_remote(pair.a.address, keys))  # decode host pulls
        assert all(pair.eb.get(keys, [got[i * block:(i + 1) * block] for i in range(n)]))  # into decode buffers
        seconds = time.perf_counter() - t0
        assert np.array_equal(kv, got)
    finally:
        pair.close()
    r = row(f"qwen3-235b-{tokens // 1024}k-tokens-e2e", nbytes, seconds, raw_s * nbytes / (1 * GIB))
    return r


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1g", help="comma list of transfer sizes in GiB, e.g. 1g,4g")
    ap.add_argument("--block-sizes", default="256k,2m,16m")
    ap.add_argument("--streams", default="1,2,3,4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "transfer.json"))
    args = ap.parse_args()
    console = Console()
    sizes = [int(s.rstrip("g")) * GIB for s in args.sizes.split(",")]
    blocks = [int(b[:-1]) * (MIB if b.endswith("m") else KIB) for b in args.block_sizes.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as workdir, console.status("benchmarking") as status:
        secret_file = os.path.join(workdir, "secret")
        Path(secret_file).write_bytes(os.urandom(32).hex().encode())
        for total in sizes:
            status.update(f"raw TCP baseline, {total // GIB} GiB")
            raw_s = raw_tcp_seconds(total, args.reps)
            for block in blocks:
                status.update(f"sidecar to sidecar, {total // GIB} GiB in {block // KIB} KiB blocks")
                results += bench_network(workdir, secret_file, total, block, streams, args.reps, raw_s)
        status.update("engine <-> sidecar through shared memory")
        results += bench_shm(workdir, secret_file, GIB, 2 * MIB, args.reps)
        status.update("Qwen3-235B-shaped 8K-token KV cache, end to end")
        raw_1g = raw_tcp_seconds(GIB, args.reps)
        results.append(bench_qwen(workdir, secret_file, 8192, 2 * MIB, max(streams), raw_1g))

    report(console, f"tpusync transfer (median of {args.reps}; loopback, {os.cpu_count()} cores)", results,
           RATE_COLUMNS, args.out,
           "baselines: raw single-stream TCP of the same bytes (pull/push, qwen e2e), single-thread memcpy "
           "(shm); qwen e2e = engine put on A + pull A->B + engine get on B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
