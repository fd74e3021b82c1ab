#!/usr/bin/env python3
"""Where the transfer time goes: each loopback path profiled on both ends with `perf record -a`.

For each case (a pull or push between two sidecars, at a block size and stream count, plain
or encrypted; raw TCP of the same bytes; an engine's get through the shared pool; memcpy), the
timed reps run under a system-wide perf sampling both cores. Every sample is put in one bucket:

  kernel copy      the kernel's copies between user memory and socket buffers
  kernel other     the rest of the kernel (the TCP/IP stack, softirqs, scheduling, page faults)
  AEGIS            libaegis in the sidecar: the frame tags (AEGIS-128X2-MAC; --encrypt's
                   AEGIS-128X2 encryption)
  libc copy        libc's memcpy/memmove (numpy's copies among them)
  tpusync          the rest of the sidecar's and the extension's own code: framing, the store,
                   the streaming copies between pool slots and engine buffers, checksums
  other            everything else in user space (Python, libc's other functions)
  idle             a core with nothing to run

and its share of both cores is turned into CPU seconds per GB moved, so the path's cost stands
beside its baseline's, bucket by bucket. Writes bench/results/profile.json (one row a case and
bucket); docs/performance.md shows it beside the transfer figures. Needs perf (Debian's
linux-perf) and root or perf_event_paranoid <= 0 for system-wide sampling; not part of
`make bench`, which needs neither: `make profile`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import rawtcp
from report import report
from rich.console import Console
from transfer_bench import GIB, KIB, MIB, Pair, keys_for

import tpusync
from tpusync.local.sidecars import write_secret

REPO = Path(__file__).resolve().parents[1]
HZ = 1000
BUCKETS = {"kernel copy": "kernel_copy", "kernel other": "kernel_other", "AEGIS": "aegis",
           "libc copy": "libc_copy", "tpusync": "tpusync", "other": "other", "idle": "idle"}
KERNEL_COPY = re.compile(r"copy_(to|from)_iter|copy_user|copy_page_to_iter|copy_page_from_iter|memcpy_orig|rep_movs")
# libaegis's functions: its API (aegis128x2_*) and the static ones of each implementation
# (state_mac_update, state_encrypt_update, aes_round, ...); and intel-ipsec-mb's, with the local
# labels of its assembly (NASM's ..@N. prefix), should a GMAC (the shared tier's) show up.
CRYPTO = re.compile(r"aegis|^state_(mac|encrypt|decrypt|init)|^(en|de)crypt_(detached|unauthenticated)$|"
                    r"^stream(_xor)?$|gmac|ghash|gcm|aes|imb_|^\.\.@", re.I)
LIBC_COPY = re.compile(r"memmove|memcpy")
# CPU seconds per GB moved, a column a bucket; then the busy total and the wall time per GB.
COLUMNS = [("case", "case", ""), *((name, f"{key}_cpu_s_per_gb", ".3f") for name, key in BUCKETS.items()),
           ("busy", "busy_cpu_s_per_gb", ".3f"), ("wall s/GB", "wall_s_per_gb", ".3f")]


def classify(comm: str, dso: str, sym: str) -> str:
    if comm == "swapper" or "native_safe_halt" in sym:
        return "idle"
    if dso == "[kernel.kallsyms]":
        return "kernel copy" if KERNEL_COPY.search(sym) else "kernel other"
    if dso.startswith("libc.so"):
        return "libc copy" if LIBC_COPY.search(sym) else "other"
    if dso == "tpusync-sidecar" or dso.startswith("_native."):
        return "AEGIS" if CRYPTO.search(sym) else "tpusync"
    return "other"


def profile(name: str, nbytes: int, run: Callable[[], None], reps: int, workdir: str) -> dict:
    """Runs `run` `reps` times under perf record -a at 1 kHz a core: a sample is a millisecond
    of one core's time, so a bucket's samples are its CPU time. Idle is what the timed reps
    left of both cores (perf's own start and stop fall outside them)."""
    data = os.path.join(workdir, f"{name}.data")
    perf = subprocess.Popen(["perf", "record", "-a", "-q", "-F", str(HZ), "-o", data],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # perf maps every core's buffer before it samples
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        seconds = time.perf_counter() - t0
    finally:
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=120)
    out = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "comm,dso,sym", "--stdio",
                          "-g", "none", "--percent-limit", "0", "-F", "overhead,sample,comm,dso,sym"],
                         capture_output=True, text=True, check=True).stdout
    cpu = dict.fromkeys(BUCKETS, 0.0)
    line = re.compile(r"^\s*[\d.]+%\s+(\d+)\s+(\S+)\s+(\S+)\s+\[[.k]\]\s+(.*?)\s*$")
    for text in out.splitlines():
        if m := line.match(text):
            bucket = classify(m.group(2), m.group(3), m.group(4))
            if bucket != "idle":
                cpu[bucket] += int(m.group(1)) / HZ
    cores = os.cpu_count() or 1
    cpu["idle"] = max(0.0, cores * seconds - sum(cpu.values()))
    gb = nbytes * reps / 1e9
    row = {"case": name, "bytes": nbytes, "reps": reps, "wall_s_per_gb": seconds / gb,
           "busy_cpu_s_per_gb": (cores * seconds - cpu["idle"]) / gb}
    return row | {f"{key}_cpu_s_per_gb": cpu[name] / gb for name, key in BUCKETS.items()}


def difference(long: dict, short: dict) -> dict:
    """The profile of what `long` did beyond `short` (the same work, more reps): per GB of the
    extra bytes, bucket by bucket."""
    extra = long["bytes"] * long["reps"] - short["bytes"] * short["reps"]
    out = {"case": long["case"], "bytes": extra, "reps": 1}
    for key in long:
        if key.endswith("_per_gb"):
            spent = long[key] * long["bytes"] * long["reps"] - short[key] * short["bytes"] * short["reps"]
            out[key] = spent / extra
    out["idle_cpu_s_per_gb"] = max(0.0, out["idle_cpu_s_per_gb"])  # a CPU-bound case's idle is noise around 0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "profile.json"))
    args = ap.parse_args()
    if shutil.which("perf") is None:
        print("perf is not installed (Debian: apt-get install linux-perf)", file=sys.stderr)
        return 2
    # The sidecar installed is stripped; the build tree's has its symbols (the same build id).
    for unstripped in (REPO / "build" / "wheel" / "native").glob("*"):
        if unstripped.name == "tpusync-sidecar" or unstripped.suffix == ".so":
            subprocess.run(["perf", "buildid-cache", "-a", str(unstripped)], check=False, capture_output=True)
    console = Console(width=160)
    total = GIB
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as workdir:
        secret = os.path.join(workdir, "secret")
        write_secret(secret, os.urandom(32).hex().encode())
        for streams in (1, 4):
            # Runs of 2n and 4n reps, each in one pair of processes: their difference is 2n reps
            # without the processes' start and their buffers' first touch, which cancel out.
            short, long = (profile(f"raw-tcp-{streams}s", total * k, lambda s=streams, k=k: rawtcp.run(total, s, k),
                                   1, workdir) for k in (args.reps * 2, args.reps * 4))
            rows.append(difference(long, short))
        for block, streams, encrypt in ((256 * KIB, 1, False), (256 * KIB, 4, False), (16 * MIB, 1, False),
                                        (2 * MIB, 4, False), (2 * MIB, 4, True)):
            n = total // block
            label = f"{block // MIB}m" if block >= MIB else f"{block // KIB}k"
            pair = Pair(workdir, secret, total + 64 * block, block, streams, encrypt)
            try:
                src = np.ones(total, np.uint8)
                keys = keys_for(1, n)
                pair.ea.put(keys, [src[i * block:(i + 1) * block] for i in range(n)])
                del src

                def pull(pair: Pair = pair, keys: np.ndarray = keys) -> None:
                    assert all(pair.eb.read_remote(pair.a.address, keys))
                    pair.eb.evict(keys)

                pull()  # the landing slots touched once, as in the benchmark's timed reps
                suffix = "-encrypted" if encrypt else ""
                rows.append(profile(f"pull-{label}-{streams}s{suffix}", total, pull, args.reps, workdir))
            finally:
                pair.close()
        block = 2 * MIB
        n = total // block
        src, dst = np.ones(total, np.uint8), np.full(total, 2, np.uint8)
        rows.append(profile("memcpy-1-thread", total, lambda: np.copyto(dst, src), args.reps * 4, workdir))
        pair = Pair(workdir, secret, total + 64 * block, block, 1)
        try:
            keys = keys_for(2, n)
            pair.ea.put(keys, [src[i * block:(i + 1) * block] for i in range(n)])
            outs = [dst[i * block:(i + 1) * block] for i in range(n)]
            rows.append(profile("shm-get-2m", total, lambda: pair.ea.get(keys, outs), args.reps * 4, workdir))
        finally:
            pair.close()
        with tpusync.KVStore.local(dram_bytes=total, block_bytes=block) as s:
            s.put(keys, [src[i * block:(i + 1) * block] for i in range(n)])
            rows.append(profile("dram-get-2m", total, lambda: s.get(keys, outs), args.reps * 4, workdir))
    report(console, f"where the time goes (perf record -a, {os.cpu_count()} cores)", rows, COLUMNS, args.out,
           "CPU seconds per GB moved, both cores, in each bucket; idle: what the timed reps left of both cores; "
           "wall s/GB: the elapsed time per GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
