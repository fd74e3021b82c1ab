"""Routing by prefix: a shared-prefix multi-turn workload over reference servers with real
sidecars, routed (a) at random, (b) by llm-d's KV-cache indexer fed by the engines' KV events
(tests/llmd/indexer: llm-d-kv-cache v0.9.0 wired as the router's precise producer; the pod it
scores first gets the request, ties at random), and (c) by the same indexer when the blocks in
host DRAM are not announced (upstream TPU Sync publishes no events for offloaded blocks; the
reference engine keeps nothing in HBM between requests, so the index stays empty), against
the physical baseline measured in the same run: every prompt computed in full (no prefix cache).

Workload: system prompts shared by many users; each user's conversation comes back turn after
turn (round-robin over users, so other traffic passes between turns), each turn the history
plus the last answer plus a new message. One request at a time; before the next request the
bench waits until the index holds the previous one's events (sync, not a sleep).

Recomputed tokens: computed tokens minus the tokens no server had seen before (the novel
part of each prompt, counted in full pages); the engine computes at least the last page.

    python bench/routing_bench.py [--servers 3] [--indexer PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
from report import report
from rich.console import Console

from tpusync.engines.reference.model import ModelConfig
from tpusync.kv.keys import BlockHasher
from tpusync.local import sidecars as sidecar
from tpusync.local.servers import interrupt
from tpusync.local.sidecars import write_secret

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for harness/
from harness.llmd_indexer import build_indexer  # noqa: E402

MODEL = {"max_seq": 1024, "layers": 2, "d_model": 128, "mlp": 256, "page_size": 32, "chunk": 32}
NAME = "tpusync/reference"


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(systems: int, users: int, turns: int, system_tokens: int, message_tokens: int, seed: int = 0):
    """(user, prompt-so-far) per request in arrival order; answers are appended as they come."""
    rng = np.random.default_rng(seed)
    system = [rng.integers(0, 256, system_tokens).tolist() for _ in range(systems)]
    messages = [[rng.integers(0, 256, message_tokens).tolist() for _ in range(turns)] for _ in range(users)]
    return system, messages


class Fleet:
    """N reference servers, each with its own sidecar, publishing KV events."""

    def __init__(self, work: Path, n: int, prefix_cache: bool):
        self.secret = work / "secret"
        write_secret(self.secret, uuid.uuid4().hex * 2)
        block = -(-ModelConfig(**MODEL).page_bytes // 4096) * 4096
        self.sidecars, self.servers, self.pools = [], [], []
        for i in range(n):
            pool = f"/dev/shm/tpusync-routing-{uuid.uuid4().hex[:8]}"
            self.pools.append(pool)
            sc = sidecar.launch(pool_path=pool, secret_file=str(self.secret), dram_bytes=2048 * block,
                                block_bytes=block, control_socket=str(work / f"{i}-{uuid.uuid4().hex[:6]}.sock"),
                                stderr=subprocess.DEVNULL)
            self.sidecars.append(sc)
            port = free_port()
            args = [sys.executable, "-m", "tpusync.serving", "--port", str(port), "--served-model-name", NAME,
                    "--model-config", json.dumps(MODEL), "--control-socket", sc.control_socket,
                    "--kv-events-endpoint", "tcp://127.0.0.1:0"]
            if not prefix_cache:
                args.append("--no-prefix-cache")
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            ready = json.loads(proc.stdout.readline())
            self.servers.append({"proc": proc, "pod": f"127.0.0.1:{port}", "url": f"http://127.0.0.1:{port}",
                                 "events": ready["kv_events_endpoint"]})

    def stop(self) -> None:
        for s in self.servers:
            interrupt(s["proc"], grace=15)
            s["proc"].stdout.close()
        for sc in self.sidecars:
            sc.stop()
        for p in self.pools:
            if os.path.exists(p):
                os.unlink(p)


class Indexer:
    def __init__(self, binary: str, block: int):
        params = {"tokenProcessorConfig": {"blockSizeTokens": block},
                  "kvEventsConfig": {"topicFilter": "kv@", "discoverPods": False},
                  "indexerConfig": {"kvCacheBackendConfigs": [{"name": "gpu", "weight": 1.0},
                                                              {"name": "cpu", "weight": 0.8},
                                                              {"name": "disk", "weight": 0.5}]}}
        self.proc = subprocess.Popen([binary, "--config", json.dumps(params)], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.url = "http://" + json.loads(self.proc.stdout.readline())["listen"]

    def sync(self, pod: str, seq: int, timeout_s: float = 10) -> bool:
        try:
            urllib.request.urlopen(f"{self.url}/sync?pod={pod}&seq={seq}&timeout_s={timeout_s}",
                                   timeout=timeout_s + 10).close()
            return True
        except urllib.error.HTTPError:
            return False

    def connect(self, server: dict) -> None:
        post(self.url + "/subscribe", {"pod": server["pod"], "endpoint": server["events"]})
        for i in range(40):  # a PUB drops what it sends before the subscription arrives
            r = post(server["url"] + "/v1/completions", {"prompt": [255 - i] * 64, "max_tokens": 1})
            if self.sync(server["pod"], r["tpusync"]["kv_events_seq"], 0.5):
                return
        raise RuntimeError(f"no events from {server['pod']}")

    def stop(self) -> None:
        interrupt(self.proc, grace=10)
        self.proc.stdout.close()


def run(mode: str, args, indexer_bin: str, work: Path) -> dict:
    fleet = Fleet(work, args.servers, prefix_cache=mode != "recompute")
    ix = Indexer(indexer_bin, MODEL["page_size"]) if mode.startswith("precise") else None
    pick = random.Random(1)
    hasher = BlockHasher(MODEL["page_size"])
    try:
        if mode == "precise":
            for s in fleet.servers:
                ix.connect(s)
        system, messages = workload(args.systems, args.users, args.turns, args.system_tokens, args.message_tokens)
        history = [list(system[u % args.systems]) for u in range(args.users)]
        seen: set[int] = set()
        ttfts, prompt_tokens, cached, computed, novel = [], 0, 0, 0, 0
        for turn in range(args.turns):
            for u in range(args.users):
                prompt = history[u] + messages[u][turn]
                server = None
                if ix:
                    got = post(ix.url + "/score", {"tokens": prompt, "model": NAME, "pods": []})
                    if got["order"]:
                        best = got["pods"][got["order"][0]]["score"]
                        tied = [p for p in got["order"] if got["pods"][p]["score"] == best]
                        pod = pick.choice(tied)
                        server = next(s for s in fleet.servers if s["pod"] == pod)
                server = server or pick.choice(fleet.servers)
                r = post(server["url"] + "/v1/completions", {"prompt": prompt, "max_tokens": args.answer_tokens})
                st = r["tpusync"]
                if mode == "precise" and st["kv_events_seq"] >= 0:
                    assert ix.sync(server["pod"], st["kv_events_seq"])
                keys = hasher.keys(prompt)
                known = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
                novel += len(prompt) - known * MODEL["page_size"]
                seen.update(keys)
                ttfts.append(st["ttft_seconds"])
                prompt_tokens += len(prompt)
                cached += st["cached_tokens"]
                computed += st["computed_tokens"]
                history[u] = prompt + r["choices"][0]["token_ids"]
        return {"case": mode, "requests": len(ttfts), "prompt_tokens": prompt_tokens,
                "prefix_hit_rate": cached / prompt_tokens, "computed_tokens": computed,
                "recomputed_tokens": computed - novel, "ttft_p50_s": statistics.median(ttfts),
                "ttft_p90_s": float(np.percentile(ttfts, 90)),
                "load_avg_1m": os.getloadavg()[0]}  # this machine is shared: how busy it was, beside each figure
    finally:
        if ix:
            ix.stop()
        fleet.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=3, choices=(2, 3, 4))
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=384)
    ap.add_argument("--message-tokens", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--indexer", default=None, help="llmd-indexer binary (default: build/find it in the cache)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "routing.json"))
    args = ap.parse_args()
    indexer = args.indexer or build_indexer()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("recompute", "random", "precise", "precise-unannounced"):
            results.append(run(mode, args, indexer, Path(tmp)))
    base = results[0]
    for r in results:
        r["ttft_p50_vs_recompute"] = r["ttft_p50_s"] / base["ttft_p50_s"]
        r["recomputed_vs_random"] = r["recomputed_tokens"] / max(1, results[1]["recomputed_tokens"])
    columns = [("routing", "case", ""), ("requests", "requests", "d"), ("prefix hit rate", "prefix_hit_rate", ".1%"),
               ("computed tok", "computed_tokens", "d"), ("recomputed tok", "recomputed_tokens", "d"),
               ("recomputed / random", "recomputed_vs_random", ".3f"), ("TTFT p50 s", "ttft_p50_s", ".4f"),
               ("TTFT p90 s", "ttft_p90_s", ".4f"), ("p50 / recompute", "ttft_p50_vs_recompute", ".2f"),
               ("load avg", "load_avg_1m", ".1f")]
    report(Console(width=160), f"Routing: {args.servers} reference servers, {args.systems} system prompts x "
           f"{args.users} users x {args.turns} turns", results, columns, args.out,
           "recompute: no prefix cache (the physical baseline). random: uniform choice. precise: the pod llm-d's "
           "indexer (v0.9.0, fed by the engines' KV events) scores first; precise-unannounced: the same indexer "
           "without events for DRAM/disk blocks. Recomputed: computed minus never-seen tokens.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
