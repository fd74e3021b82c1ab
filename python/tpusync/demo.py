"""`make demo`: disaggregated serving with tpusync on one machine, checked token for token.

Starts on 127.0.0.1 two sidecars (the prefill host's and the decode host's), a prefill server,
a decode server and, for reference, a monolithic server without any cache. The servers run a
tiny model (4 layers, random weights) on the CPU: the times compare the three paths with each
other, not with a real model on TPUs. Sends requests
that share a long prefix and, for each, prints the time to first token monolithic vs
disaggregated (prefill, KV pulled sidecar to sidecar, decode) vs a prefix-cache hit, the
bytes moved and the transfer time, and checks that all three produced the same tokens.
Ends with what the run showed (TTFT ratios against monolithic serving, the KV bytes the
decode host did not pull because it held them) and what to try next. Exits non-zero on any
mismatch; stops everything it started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tpusync import cli
from tpusync.engines.reference.model import ModelConfig, init_params
from tpusync.local import sidecars as sidecar
from tpusync.local.servers import start_server

MODEL: dict[str, Any] = {"max_seq": 2048}
SHARED_PREFIX, SUFFIX, MAX_TOKENS, REQUESTS = 1536, 256, 16, 6


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float, list[int]]:
    """POSTs a streaming completion; returns the final chunk, the time to first token, the tokens."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, ttft, final = time.perf_counter(), None, {}
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            ids = chunk["choices"][0].get("token_ids") or []
            if ids and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += ids
            final = chunk
    if ttft is None:
        raise RuntimeError("the server streamed no tokens")
    return final, ttft, tokens


def model_note(cfg: ModelConfig, platform: str = "cpu") -> str:
    """What the servers run, said before any number (no allocation: the shapes only)."""
    where = "the CPU" if platform == "cpu" else platform
    params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(jax.eval_shape(lambda: init_params(cfg))))
    return (f"The servers run a tiny model on {where}: {cfg.layers} layers, d_model {cfg.d_model}, "
            f"{params / 1e6:.1f} M random {cfg.dtype} weights, {cfg.page_size}-token pages. Its times compare the "
            "three ways to serve a prompt with each other; a real model on TPUs takes other times.")


def legend(cfg: ModelConfig) -> str:
    """What the table's columns and its first row mean."""
    return "\n".join([
        "mono: one server that prefills and decodes itself, with no prefix cache (every prompt computed whole): "
        "the baseline.",
        "P/D TTFT: the prefill request + decode's first token (its KV pulled sidecar to sidecar, only the blocks "
        "it lacks).",
        "req 0 is cold: nothing is cached yet, so prefill computes the whole prompt and decode pulls every page. "
        "From req 1 on, the shared prefix is cached on both hosts: prefill computes only what follows it, decode "
        "pulls only those pages.",
        f"hit: the same prompt again, served from the decode host's DRAM. hit computed is {cfg.chunk}, not 0: the "
        f"engine computes in chunks of {cfg.chunk} tokens ({cfg.chunk // cfg.page_size} pages) and always computes "
        "again the chunk holding the prompt's last token, whose logits give the first generated token.",
    ])


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, "python -m tpusync.demo", argv)


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tpusync.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=cli.positive(int), default=REQUESTS, help="requests sharing the prefix")
    ap.add_argument("--platform", default="cpu", choices=("cpu", "cuda", "rocm", "tpu"),
                    help="the JAX platform the model servers run on: cpu (the default, whatever accelerator this "
                         "machine has), or cuda, rocm or tpu where it has one (bench/device_check.py)")
    cli.add_debug(ap)
    args = ap.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = args.platform   # the servers'
    console = Console(width=max(Console().width, 132))
    cfg = ModelConfig(**MODEL)
    console.print(model_note(cfg, args.platform))
    block = -(-cfg.page_bytes // 4096) * 4096
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, cfg.vocab, SHARED_PREFIX).tolist()
    prompts = [prefix + rng.integers(0, cfg.vocab, SUFFIX).tolist() for _ in range(args.requests)]
    table = Table(title=f"tpusync demo: {args.requests} requests, {SHARED_PREFIX}-token shared prefix + "
                        f"{SUFFIX} own tokens, {MAX_TOKENS} generated (TTFT in ms; a tiny model on the CPU)")
    for col in ("req", "mono TTFT", "P/D TTFT", "prefill computed", "KV pulled", "transfer ms", "hit TTFT",
                "hit computed", "tokens"):
        table.add_column(col, justify="right")
    runs: list[Run] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("starting sidecars and model servers", total=5 + args.requests)
        with servers(block, lambda n: progress.advance(task, n)) as serving:
            for i, prompt in enumerate(prompts):
                progress.update(task, description=f"request {i + 1}/{args.requests}")
                runs.append(serving.run(prompt, len(prompt) // cfg.page_size * block))
                table.add_row(str(i), *runs[-1].row)
                progress.advance(task)
    console.print(table)
    console.print(legend(cfg))
    return summary(console, runs)


@dataclass
class Run:
    """One prompt served the three ways: its times (s), the decode host's pull, the table row."""

    same: bool           # the three produced the same tokens
    mono: float          # TTFT, monolithic
    pd: float            # TTFT, prefill + decode
    hit: float           # TTFT, the prefix-cache hit
    pulled: int          # KV bytes decode pulled
    prompt_kv: int       # the prompt's KV bytes
    row: list[str]


@dataclass
class Servers:
    mono: Any
    prefill: Any
    decode: Any

    def run(self, prompt: list[int], prompt_kv: int) -> Run:
        """The prompt monolithic, then prefill -> decode through the sidecars, then again on
        decode (a prefix hit)."""
        _, mono_ttft, mono_tokens = post(self.mono.url, {"prompt": prompt, "max_tokens": MAX_TOKENS})
        p_final, p_ttft, p_tokens = post(self.prefill.url, {"prompt": prompt, "max_tokens": 1})
        params = p_final.get("kv_transfer_params")
        if params is None:
            raise RuntimeError(f"the prefill server returned no kv_transfer_params: {p_final}")
        d_final, d_ttft, d_tokens = post(self.decode.url, {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                           "kv_transfer_params": params})
        h_final, h_ttft, h_tokens = post(self.decode.url, {"prompt": prompt, "max_tokens": MAX_TOKENS})
        d_stats, p_stats, h_stats = d_final["tpusync"], p_final["tpusync"], h_final["tpusync"]
        same = mono_tokens == d_tokens == h_tokens and p_tokens == mono_tokens[:1]
        row = [f"{mono_ttft * 1e3:.0f}", f"{(p_ttft + d_ttft) * 1e3:.0f}", f"{p_stats['computed_tokens']}",
               f"{d_stats['pulled_bytes'] / 2**20:.1f} MiB", f"{d_stats['transfer_seconds'] * 1e3:.1f}",
               f"{h_ttft * 1e3:.0f}", f"{h_stats['computed_tokens']}",
               "[green]equal[/]" if same else "[red]MISMATCH[/]"]
        return Run(same, mono_ttft, p_ttft + d_ttft, h_ttft, d_stats["pulled_bytes"], prompt_kv, row)


@contextlib.contextmanager
def servers(block: int, started_one: Callable[[int], None]) -> Iterator[Servers]:
    """The prefill and decode hosts' sidecars on 127.0.0.1, a monolithic server without a cache,
    a prefill and a decode server on those sidecars; `started_one(n)` as they come up. All
    stopped, and the pools removed, on exit."""
    started: list[Any] = []
    pools = [f"/dev/shm/tpusync-demo-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    with tempfile.TemporaryDirectory() as work:
        try:
            secret = os.path.join(work, "secret")
            sidecar.write_secret(secret, uuid.uuid4().hex * 2)
            p_side, d_side = (
                sidecar.launch(pool_path=pool, secret_file=secret, dram_bytes=256 << 20, block_bytes=block,
                               control_socket=os.path.join(work, f"{name}.sock"), stderr=subprocess.DEVNULL)
                for name, pool in zip(("prefill", "decode"), pools)
            )
            started += [p_side, d_side]
            started_one(2)
            quiet = subprocess.DEVNULL
            for role, options in (("both", {"prefix_cache": False}),
                                  ("prefill", {"control_socket": p_side.control_socket,
                                               "data_address": p_side.address}),
                                  ("decode", {"control_socket": d_side.control_socket, "data_address": d_side.address,
                                              "peers": [p_side.address]})):
                started.append(start_server(role, model_config=MODEL, stderr=quiet, **options))
                started_one(1)
            yield Servers(*started[2:])
        finally:
            for proc in reversed(started):
                proc.stop()
            for pool in pools:
                if os.path.exists(pool):
                    os.unlink(pool)


def summary(console: Console, runs: list[Run]) -> int:
    """What the run showed, or which requests differed: the exit status."""
    failures = sum(not r.same for r in runs)
    if failures:
        console.print(f"[red]{failures} request(s) produced different tokens[/]")
        return 1
    console.print("[green]all runs produced identical tokens[/]")
    median = statistics.median
    mono = median(r.mono for r in runs)
    pulled = sum(r.pulled for r in runs)
    not_pulled = sum(r.prompt_kv for r in runs) - pulled
    console.print(
        f"What this showed: P/D TTFT {median(r.pd for r in runs) / mono:.2f} x and a DRAM prefix hit "
        f"{median(r.hit for r in runs) / mono:.2f} x monolithic (medians); the decode host pulled "
        f"{pulled / 2**20:.1f} MiB of KV and did not pull {not_pulled / 2**20:.1f} MiB it already held "
        "(the shared prefix, after the first request).\n"
        "Next: `make test` (every tier, real engines included), docs/serving.md (the reference server), "
        "docs/vllm.md (vLLM with TPUSyncConnector), docs/weights.md (RL weight updates), docs/gke.md (install).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
