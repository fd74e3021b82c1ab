"""The SGLang tier: tpusync as SGLang's HiCache L3 storage backend, on SGLang's real code on the CPU.

Runs in the SGLang environment (`make sglang-test`, tests/sglang/sglang.mk); the main .venv has no
SGLang, so there this folder collects nothing and says so. Host pools and the backend are built
the way SGLang builds them (harness/sglang_pools.py, shared with bench/sglang_bench.py). Sidecars
are real tpusync-sidecar processes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import not_collected
from tpusync.local import sidecars as sidecar_mod
from tpusync.local.sidecars import write_secret

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("torch") is None:
    collect_ignore_glob = not_collected("tests/sglang",
                                        "no SGLang here; `make sglang-test` runs it in its own environment")

SECRET = b"sglang-tier-secret-0123456789abcdef"
BLOCK = 16 << 10
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def fill(pool: Any, pages: int, seed: int = 0) -> Any:
    """Allocates `pages` pages in the host pool and writes random bytes into every buffer of them."""
    import torch

    indices = pool.alloc(pages * pool.page_size)
    assert indices is not None
    gen = torch.Generator().manual_seed(seed)
    buf = pool.kv_buffer
    noise = torch.randn(buf.shape, generator=gen, dtype=torch.float32).to(buf.dtype)
    buf.copy_(noise)
    return indices


def pages_of(pool: Any, indices: Any) -> list[Any]:
    return [pool.get_data_page(int(indices[i * pool.page_size]), flat=True).clone()
            for i in range(len(indices) // pool.page_size)]


def hashes(n: int, tag: str = "") -> list[str]:
    return [f"{tag}{uuid.uuid4().hex}{i:04d}" for i in range(n)]


@dataclass
class Host:
    sidecar: sidecar_mod.Sidecar
    socket: str
    pool_path: str


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    return write_secret(tmp_path / "secret", SECRET)


@pytest.fixture
def launch(tmp_path: Path, secret_file: str):
    """launch(name, **kw) starts (or, for a name seen before, restarts on the same pool file and
    control socket) a real sidecar; all are stopped afterwards and their pool files removed."""
    started: list[sidecar_mod.Sidecar] = []
    pools: dict[str, str] = {}

    def _launch(name: str, *, dram_bytes: int = 8 << 20, block_bytes: int = BLOCK, **kw: Any) -> Host:
        pool = pools.setdefault(name, f"/dev/shm/tpusync-sglang-{os.getpid()}-{name}-{uuid.uuid4().hex[:6]}")
        sock = str(tmp_path / f"{name}.sock")
        s = sidecar_mod.launch(pool_path=pool, secret_file=secret_file, dram_bytes=dram_bytes,
                               block_bytes=block_bytes, control_socket=sock, stderr=subprocess.DEVNULL, **kw)
        started.append(s)
        return Host(s, sock, pool)

    yield _launch
    for s in started:
        if s.process.poll() is None:
            s.stop()
    for p in pools.values():
        for path in (p, p + ".lock"):
            if os.path.exists(path):
                os.unlink(path)
