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
    seen: dict[str, list[float]] = {"mono": [], "pd": [], "hit": [], "pulled": [], "prompt_kv": []}
    started: list[Any] = []
    pools = [f"/dev/shm/tpusync-demo-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    failures = 0
    with tempfile.TemporaryDirectory() as work, Progress(console=console, transient=True) as progress:
        try:
            secret = os.path.join(work, "secret")
            sidecar.write_secret(secret, uuid.uuid4().hex * 2)
            task = progress.add_task("starting sidecars and model servers", total=5 + args.requests)
            p_side, d_side = (
                sidecar.launch(pool_path=pool, secret_file=secret, dram_bytes=256 << 20, block_bytes=block,
                               control_socket=os.path.join(work, f"{name}.sock"), stderr=subprocess.DEVNULL)
                for name, pool in zip(("prefill", "decode"), pools)
            )
            started += [p_side, d_side]
            progress.advance(task, 2)
            quiet = subprocess.DEVNULL
            mono = start_server("both", model_config=MODEL, prefix_cache=False, stderr=quiet)
            started.append(mono)
            progress.advance(task)
            prefill = start_server("prefill", model_config=MODEL, control_socket=p_side.control_socket,
                                   data_address=p_side.address, stderr=quiet)
            started.append(prefill)
            progress.advance(task)
            decode = start_server("decode", model_config=MODEL, control_socket=d_side.control_socket,
                                  data_address=d_side.address, peers=[p_side.address], stderr=quiet)
            started.append(decode)
            progress.advance(task)

            table = Table(title=f"tpusync demo: {args.requests} requests, {SHARED_PREFIX}-token shared prefix + "
                                f"{SUFFIX} own tokens, {MAX_TOKENS} generated (TTFT in ms; a tiny model on the CPU)")
            for col in ("req", "mono TTFT", "P/D TTFT", "prefill computed", "KV pulled", "transfer ms",
                        "hit TTFT", "hit computed", "tokens"):
                table.add_column(col, justify="right")
            for i, prompt in enumerate(prompts):
                progress.update(task, description=f"request {i + 1}/{args.requests}")
                _, mono_ttft, mono_tokens = post(mono.url, {"prompt": prompt, "max_tokens": MAX_TOKENS})
                p_final, p_ttft, p_tokens = post(prefill.url, {"prompt": prompt, "max_tokens": 1})
                params = p_final.get("kv_transfer_params")
                if params is None:
                    raise RuntimeError(f"the prefill server returned no kv_transfer_params: {p_final}")
                d_final, d_ttft, d_tokens = post(decode.url, {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                              "kv_transfer_params": params})
                h_final, h_ttft, h_tokens = post(decode.url, {"prompt": prompt, "max_tokens": MAX_TOKENS})
                d_stats, p_stats, h_stats = d_final["tpusync"], p_final["tpusync"], h_final["tpusync"]
                same = mono_tokens == d_tokens == h_tokens and p_tokens == mono_tokens[:1]
                failures += not same
                seen["mono"].append(mono_ttft)
                seen["pd"].append(p_ttft + d_ttft)
                seen["hit"].append(h_ttft)
                seen["pulled"].append(d_stats["pulled_bytes"])
                seen["prompt_kv"].append(len(prompt) // cfg.page_size * block)
                table.add_row(
                    str(i), f"{mono_ttft * 1e3:.0f}", f"{(p_ttft + d_ttft) * 1e3:.0f}",
                    f"{p_stats['computed_tokens']}", f"{d_stats['pulled_bytes'] / 2**20:.1f} MiB",
                    f"{d_stats['transfer_seconds'] * 1e3:.1f}", f"{h_ttft * 1e3:.0f}", f"{h_stats['computed_tokens']}",
                    "[green]equal[/]" if same else "[red]MISMATCH[/]")
                progress.advance(task)
        finally:
            for proc in reversed(started):
                proc.stop()
            for pool in pools:
                if os.path.exists(pool):
                    os.unlink(pool)
    console.print(table)
    console.print(legend(cfg))
    if failures:
        console.print(f"[red]{failures} request(s) produced different tokens[/]")
        return 1
    console.print("[green]all runs produced identical tokens[/]")
    median = statistics.median
    not_pulled = sum(seen["prompt_kv"]) - sum(seen["pulled"])
    console.print(
        f"What this showed: P/D TTFT {median(seen['pd']) / median(seen['mono']):.2f} x and a DRAM prefix hit "
        f"{median(seen['hit']) / median(seen['mono']):.2f} x monolithic (medians); the decode host pulled "
        f"{sum(seen['pulled']) / 2**20:.1f} MiB of KV and did not pull {not_pulled / 2**20:.1f} MiB it already held "
        "(the shared prefix, after the first request).\n"
        "Next: `make test` (every tier, real engines included), docs/serving.md (the reference server), "
        "docs/vllm.md (vLLM with TPUSyncConnector), docs/weights.md (RL weight updates), docs/gke.md (install).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
