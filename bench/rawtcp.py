"""The native raw TCP baseline (bench/rawtcp.cc): build it, run N streams, return the figures.

The sender and the receiver are separate processes, started by `popen` functions so the
fabric benchmark can start them inside two simulated hosts (Host.popen) while the loopback
benchmarks use plain subprocess.Popen.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = Path(__file__).with_name("rawtcp.cc")


def binary() -> str:
    """build/bench/rawtcp-<source hash>, compiled with g++ -O2 when missing."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    out = REPO / "build" / "bench" / f"rawtcp-{digest}"
    if not out.exists():
        cxx = os.environ.get("CXX") or shutil.which("g++") or "c++"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", "-Wall", "-Wextra", "-o", str(tmp), str(SOURCE)],
                       check=True)
        tmp.rename(out)
    return str(out)


@dataclass
class RawResult:
    seconds: float          # median over reps, receiver's clock: "go" to last byte
    cpu_seconds: float      # median over reps, sender + receiver, all threads
    reps: list[float]


def run(total: int, streams: int, reps: int, *, bind_ip: str = "127.0.0.1",
        recv_popen: Callable[..., subprocess.Popen] = subprocess.Popen,
        send_popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> RawResult:
    """`streams` raw TCP streams carrying `total` bytes between two processes, `reps` times."""
    exe = binary()
    recv = recv_popen([exe, "recv", bind_ip, str(streams), str(total), str(reps)], stdout=subprocess.PIPE, text=True)
    try:
        first = recv.stdout.readline().split()
        if first[:1] != ["port"]:
            raise RuntimeError(f"rawtcp recv did not start (exit {recv.wait()})")
        send = send_popen([exe, "send", f"{bind_ip}:{first[1]}", str(streams), str(total), str(reps)],
                          stdout=subprocess.PIPE, text=True)
        recv_out, _ = recv.communicate(timeout=600)
        send_out, _ = send.communicate(timeout=60)
        if recv.returncode or send.returncode:
            raise RuntimeError(f"rawtcp failed: recv {recv.returncode}, send {send.returncode}")
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    r = [json.loads(line) for line in recv_out.splitlines() if line.startswith("{")]
    s = [json.loads(line) for line in send_out.splitlines() if line.startswith("{")]
    seconds = [x["seconds"] for x in r]
    cpu = [a["cpu_seconds"] + b["cpu_seconds"] for a, b in zip(r, s)]
    return RawResult(statistics.median(seconds), statistics.median(cpu), seconds)
