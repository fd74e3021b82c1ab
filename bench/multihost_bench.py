#!/usr/bin/env python3
"""Multi-host P/D benchmark: the KV transfer of a prefill/decode pair of reference engines on
simulated hosts (harness/fabric.py: one network namespace per host, each NIC shaped at a
data-center profile, 1 Gbit/s, 100 us RTT), the same prompt bytes in every case:

- pd-singlehost: one-host prefill and decode engines (one device each): one link carries it all;
- pd-multihost: a prefill slice and a decode slice of two hosts each (2 devices a host, the cache
  split over 4 by kv heads): each decode host pulls its half from its prefill counterpart, the
  two links at once;
- pd-hetero-tp2-tp4: a prefill slice of tensor parallelism 2 (two hosts, one device each) to the
  decode slice of 4: each decode host pulls the parts of the prefill's shards its heads overlap.

Every engine process and sidecar runs inside its host; the slices' collectives (jax.distributed,
gloo) cross the shaped links too. The transfer time is the slowest decode host's pulls (the
slice waits for the last). ratio = transfer seconds / one host's share of the bytes at line rate
(baseline_seconds): near 1 when each host's link is the bound and the hosts pull in parallel.
The save (prefill) and load (decode) seconds are reported beside it: the whole P/D cost.
Merges its cases into bench/results/serving.json. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from report import report_merged
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.fabric import DC, Fabric, Host, in_namespace
from tpusync.engines.reference.model import ModelConfig
from tpusync.local.servers import read_ready
from tpusync.local.sidecars import terminate, write_secret

MODEL = {"layers": 4, "heads": 4, "kv_heads": 4, "head_dim": 64, "d_model": 256, "mlp": 512, "max_seq": 4096}
CFG = ModelConfig(**MODEL)
TOKENS = 2048
HTTP_PORT, COORDINATOR_PORT = 9500, 9510
COLUMNS = [("case", "case", "s"), ("hosts", "hosts_per_side", "d"), ("MiB/host", "bytes_per_host", ".2f"),
           ("transfer s", "seconds", ".4f"), ("line-rate share s", "baseline_seconds", ".4f"),
           ("ratio", "ratio", ".3f"), ("save s", "save_seconds", ".4f"), ("load s", "load_seconds", ".4f")]
NOTE = ("ratio = the P/D transfer (the slowest decode host's pulls) / one host's share of the bytes at the "
        "fabric's line rate (1 Gbit/s per host); the same prompt bytes in every case")


def post(host: Host, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """An HTTP request from inside `host` (the engines listen on fabric addresses only)."""
    def send() -> dict[str, Any]:
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            out: dict[str, Any] = json.load(resp)
            return out
    return in_namespace(host.ns, send)


def start(role: str, hosts: list[Host], sidecars: dict[str, Any], devices: int,
          procs: list[subprocess.Popen[str]]) -> str:
    """Engines of one side on `hosts` (a slice when more than one), added to `procs`; returns the
    leader's URL."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    mine = []
    for i, h in enumerate(hosts):
        sc = sidecars[h.name]
        argv = [sys.executable, "-m", "tpusync.serving", "--role", role, "--host", h.ip, "--port", str(HTTP_PORT),
                "--model-config", json.dumps(MODEL), "--control-socket", sc.control_socket,
                "--data-address", sc.address]
        if len(hosts) > 1:
            argv += ["--num-processes", str(len(hosts)), "--process-id", str(i),
                     "--coordinator", f"{hosts[0].ip}:{COORDINATOR_PORT}", "--cpu-devices", str(devices)]
        elif devices > 1:
            raise ValueError("a one-host engine has one device here")
        mine.append(h.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env))
    procs += mine
    for i, p in enumerate(mine):
        read_ready(p, f"{role} process {i}")
    return f"http://{hosts[0].ip}:{HTTP_PORT}"


@contextlib.contextmanager
def hostnames(hosts: list[Host]) -> Iterator[None]:
    """This machine's name resolves to each host's fabric address inside that host: gloo (the
    slices' collectives) advertises the address its hostname resolves to, as on real hosts.
    `ip netns exec` mounts /etc/netns/<namespace>/hosts over /etc/hosts."""
    name = socket.gethostname()
    for h in hosts:
        d = Path("/etc/netns") / h.ns
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text(f"127.0.0.1 localhost\n{h.ip} {name}\n")
    try:
        yield
    finally:
        for h in hosts:
            shutil.rmtree(Path("/etc/netns") / h.ns, ignore_errors=True)


def run_case(name: str, fabric: Fabric, sidecars: dict[str, Any], prefill: tuple[list[Host], int],
             decode: tuple[list[Host], int], reps: int, seed: int) -> dict[str, Any]:
    procs: list[subprocess.Popen[str]] = []
    runs = []
    try:
        p_url = start("prefill", prefill[0], sidecars, prefill[1], procs)
        d_url = start("decode", decode[0], sidecars, decode[1], procs)
        client = prefill[0][0]
        rng = np.random.default_rng(seed)
        for _ in range(reps + 1):  # the first: compiles the loads
            prompt = rng.integers(0, CFG.vocab, TOKENS).tolist()
            first = post(client, p_url, {"prompt": prompt, "max_tokens": 1})
            decoded = post(client, d_url, {"prompt": prompt, "max_tokens": 2,
                                           "kv_transfer_params": first["kv_transfer_params"]})
            st = decoded["tpusync"]
            if st["cached_tokens"] < TOKENS // CFG.chunk * CFG.chunk - CFG.chunk:
                raise RuntimeError(f"{name}: the decode side computed the prompt ({st})")
            runs.append({"transfer": st["transfer_seconds"], "load": st["load_seconds"],
                         "save": first["tpusync"]["save_seconds"]})
    finally:
        # Gone before the next case starts: a slice still shutting down keeps its coordinator's port,
        # and the next slice's followers would join it.
        for p in procs:
            terminate(p)
    runs = runs[1:]
    hosts = len(decode[0])
    per_host = TOKENS // CFG.page_size * CFG.page_bytes // hosts
    share = per_host / fabric.profile.rate_bytes_per_s
    transfer = statistics.median(r["transfer"] for r in runs)
    return {"case": f"{name}-{TOKENS // 1024}k", "tokens": TOKENS, "hosts_per_side": hosts,
            "bytes_per_host": round(per_host / 2**20, 2), "seconds": round(transfer, 4),
            "baseline_seconds": round(share, 4), "ratio": round(transfer / share, 3),
            "save_seconds": round(statistics.median(r["save"] for r in runs), 4),
            "load_seconds": round(statistics.median(r["load"] for r in runs), 4),
            "runs": [round(r["transfer"], 4) for r in runs], "profile": fabric.profile.name}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serving.json"))
    args = ap.parse_args()
    console = Console()
    block = -(-CFG.page_bytes // 4096) * 4096
    results = []
    with tempfile.TemporaryDirectory() as work, Fabric(4, DC) as fabric, hostnames(fabric.hosts):
        secret = os.path.join(work, "secret")
        write_secret(secret, uuid.uuid4().hex * 2)
        os.chmod(work, 0o755)
        sidecars = {h.name: h.sidecar(secret_file=secret, dram_bytes=512 << 20, block_bytes=block)
                    for h in fabric.hosts}
        h0, h1, h2, h3 = fabric.hosts
        with console.status("pd-singlehost"):
            results.append(run_case("pd-singlehost", fabric, sidecars, ([h0], 1), ([h2], 1), args.reps, 1))
        with console.status("pd-multihost"):
            results.append(run_case("pd-multihost", fabric, sidecars, ([h0, h1], 2), ([h2, h3], 2), args.reps, 2))
        with console.status("pd-hetero-tp2-tp4"):
            results.append(run_case("pd-hetero-tp2-tp4", fabric, sidecars, ([h0, h1], 1), ([h2, h3], 2),
                                    args.reps, 3))
    report_merged(console, "Multi-host P/D on the fabric: KV transfer vs one host's share at line rate", results,
                  COLUMNS, args.out, NOTE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
