#!/usr/bin/env python3
"""SGLang HiCache L3 benchmark: tpusync's backend against a memcpy of the same pages, in one run.

Runs in the SGLang tier's environment (tests/sglang/sglang.mk: `make sglang-bench`, or
`build/sglang-venv/bin/python bench/sglang_bench.py`). A real tpusync-sidecar; SGLang 0.5.23's
real host pools (built as the SGLang tier builds them: harness/sglang_pools.py); the backend made by SGLang's
factory from the extra config. Per layout, one batch of pages (SGLang hands the backend at most
STORAGE_BATCH_SIZE = 128 pages a call: sglang/srt/mem_cache/hicache_storage.py):

- hicache-set-<layout>: batch_set_v1 of the batch (host pool -> the sidecar's shared-memory pool),
  against a memcpy of the same page buffers (the pointers get_page_buffer_meta gives) into a
  pre-faulted buffer;
- hicache-get-<layout>: batch_get_v1 of those pages into other pages of the pool, against a
  memcpy of the same bytes back into the same page buffers.

ratio = memcpy seconds / backend seconds (1.0: as fast as copying the bytes once), the median of
the rounds' ratios (each round times both back to back). Every timed
round follows an untimed one, and each round stores fresh keys (evicted after), so no round finds
its pages already stored. Prints a table and writes bench/results/sglang.json.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np
import torch
from report import RATE_COLUMNS, report, timed
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.sglang_pools import make_backend, make_pool
from tpusync import KVStore
from tpusync.engines.sglang.keys import block_keys
from tpusync.local import sidecars as sidecar_mod
from tpusync.local.sidecars import write_secret

MIB = 1 << 20
# One TP rank of a Llama-3-8B-shaped model: 32 layers x 8 KV heads x 128 x bf16, 16-token pages:
# a page is 2 MiB (1 MiB of K, 1 MiB of V).
LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
CASES = [("page_first", False), ("page_first_direct", False), ("layer_first", False), ("page_first", True),
         ("layer_first", True)]
COLUMNS = [*RATE_COLUMNS, ("memcpy s", "baseline_seconds", ".4f"), ("pages", "pages", "d"),
           ("load", "load_avg_1m", ".1f")]


def _memcpy_pages(ptrs: list[int], sizes: list[int], staging: np.ndarray, *, into_pool: bool) -> None:
    base = int(staging.ctypes.data)
    offset = 0
    for ptr, size in zip(ptrs, sizes):
        if into_pool:
            ctypes.memmove(ptr, base + offset, size)
        else:
            ctypes.memmove(base + offset, ptr, size)
        offset += size


def bench_case(host_socket: str, client: KVStore, layout: str, mla: bool, pages: int, reps: int) -> list[dict]:
    tokens = 2 * pages * PAGE + 64
    pool = make_pool(layout, mla=mla, tokens=tokens, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page=PAGE)
    backend = make_backend(pool, {"control_socket": host_socket}, mla=mla)
    src = pool.alloc(pages * PAGE)
    dst = pool.alloc(pages * PAGE)
    pool.kv_buffer.view(torch.uint8).random_(0, 256)  # in place: no float temporary of the pool's size
    src_ptrs, src_sizes = pool.get_page_buffer_meta(src)
    dst_ptrs, dst_sizes = pool.get_page_buffer_meta(dst)
    nbytes = sum(src_sizes)
    staging = np.ones(nbytes, np.uint8)  # pre-faulted
    sets, gets, copies_out, copies_in = [], [], [], []
    for r in range(reps + 1):
        keys = [f"{uuid.uuid4().hex}{i:04d}" for i in range(pages)]
        t_set = timed(lambda keys=keys: assert_all(backend.batch_set_v1(keys, src)))
        t_get = timed(lambda keys=keys: assert_all(backend.batch_get_v1(keys, dst)))
        t_out = timed(lambda: _memcpy_pages(src_ptrs, src_sizes, staging, into_pool=False))
        t_in = timed(lambda: _memcpy_pages(dst_ptrs, dst_sizes, staging, into_pool=True))
        inner = getattr(backend, "_backend", backend)
        client.evict(block_keys(inner._namespace, keys, inner._plan.slots))
        if r:  # the first round faults the pool's pages in: untimed
            sets.append(t_set)
            gets.append(t_get)
            copies_out.append(t_out)
            copies_in.append(t_in)
    for i in range(0, pages * PAGE, PAGE):  # random bytes: compare them as bytes (some are NaNs as bf16)
        assert torch.equal(pool.get_data_page(int(src[i])).view(torch.uint8),
                           pool.get_data_page(int(dst[i])).view(torch.uint8))
    backend.close()
    name = f"{'mla-' if mla else ''}{layout}"
    return [row(f"hicache-set-{name}", nbytes, sets, copies_out, pages),
            row(f"hicache-get-{name}", nbytes, gets, copies_in, pages)]


def assert_all(ok: list[bool]) -> None:
    assert all(ok), ok


def row(case: str, nbytes: int, backend: list[float], memcpy: list[float], pages: int) -> dict:
    """Medians; the ratio is the median of each round's memcpy / backend (a round times both back to
    back, so load that drifts on this shared machine weighs on both alike)."""
    seconds, baseline_seconds = statistics.median(backend), statistics.median(memcpy)
    return {"case": case, "bytes": nbytes, "pages": pages, "seconds": seconds, "baseline_seconds": baseline_seconds,
            "gbps": nbytes / seconds / 1e9, "baseline_gbps": nbytes / baseline_seconds / 1e9,
            "ratio": statistics.median(m / b for m, b in zip(memcpy, backend)), "baseline": "memcpy-same-pages",
            "load_avg_1m": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64, help="pages per call (SGLang passes at most 128)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sglang.json"))
    args = ap.parse_args()
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        secret = write_secret(Path(work) / "secret", b"sglang-bench-secret-0123456789abcdef")
        pool_path = f"/dev/shm/tpusync-sglang-bench-{uuid.uuid4().hex[:8]}"
        page_bytes = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2
        host = sidecar_mod.launch(pool_path=pool_path, secret_file=secret, dram_bytes=4 * args.pages * page_bytes,
                                  block_bytes=2 * MIB, control_socket=f"{work}/s.sock", stderr=subprocess.DEVNULL)
        client = KVStore.connect(f"unix://{work}/s.sock")
        try:
            for layout, mla in CASES:
                results += bench_case(f"{work}/s.sock", client, layout, mla, args.pages, args.reps)
        finally:
            client.close()
            host.stop()
            for path in (pool_path, pool_path + ".lock"):
                if os.path.exists(path):
                    os.unlink(path)
    report(Console(width=150), "SGLang HiCache L3 on tpusync vs memcpy of the same pages", results, COLUMNS, args.out,
           f"{args.pages} pages a call, {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM} x bf16, {PAGE}-token pages "
           "(MLA: a 128+8 latent of the same layers); medians of "
           f"{args.reps} rounds; ratio = the median of the rounds' memcpy s / backend s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
