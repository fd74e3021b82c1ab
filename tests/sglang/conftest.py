"""The SGLang tier: tpusync as SGLang's HiCache L3 storage backend, on SGLang's real code on the CPU.

Runs in the SGLang environment (`make sglang-test`, tests/sglang/sglang.mk); the main .venv has no
SGLang, so there this folder collects nothing and says so. Host pools are built by SGLang's own
constructors from SGLang's own device pools (sglang 0.5.23: sglang/srt/mem_cache/memory_pool.py
MHATokenToKVPool / MLATokenToKVPool on device "cpu", sglang/srt/mem_cache/pool_host/mha.py
MHATokenToKVPoolHost via get_mha_host_pool_cls, pool_host/mla.py MLATokenToKVPoolHost, with the
arguments sglang/srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py::_build_mha_mla_host_pool
passes), and the backend by SGLang's StorageBackendFactory from the extra config, as
`--hicache-storage-backend dynamic` does. Sidecars are real tpusync-sidecar processes.
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
PAGE = 4          # tokens per page
LAYERS = 3
HEADS = 2
HEAD_DIM = 16
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
BACKEND = {"backend_name": "tpusync", "module_path": "tpusync.sglang.storage",
           "class_name": "TPUSyncHiCacheStorage", "interface_v1": 1}


def make_pool(layout: str, *, mla: bool = False, tokens: int = 256, layers: int = LAYERS, heads: int = HEADS,
              head_dim: int = HEAD_DIM, page: int = PAGE, dtype: Any = None) -> Any:
    """A real SGLang host pool over a real device pool, both on the CPU.

    SGLang sizes host pools against the machine's free memory less a 10 GiB reserve
    (pool_host/base.py, HICACHE_HOST_MEMORY_RESERVE_BYTES): on a busy test machine that refuses
    even these small pools, so they are booked against the memory actually available, through
    SGLang's own budget scope (pool_host/base.py, host_memory_budget_scope)."""
    import psutil
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with host_memory_budget_scope(psutil.virtual_memory().available):
        return _make_pool(layout, mla=mla, tokens=tokens, layers=layers, heads=heads, head_dim=head_dim, page=page,
                          dtype=dtype)


def _make_pool(layout: str, *, mla: bool, tokens: int, layers: int, heads: int, head_dim: int, page: int,
               dtype: Any) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    common = {"host_to_device_ratio": 2.0, "host_size": 0, "page_size": page, "layout": layout,
              "pin_memory": False, "device": "cpu"}
    if mla:
        dev = MLATokenToKVPool(tokens, page, dtype, head_dim, 8, layers, "cpu", False, start_layer=0,
                               end_layer=layers)
        return MLATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info, **common,
            device_capacity_tokens=dev.size if dev.host_capacity_tokens is None else dev.host_capacity_tokens,
            start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=dev.layer_num,
            override_kv_cache_dim=dev.kv_cache_dim)
    dev = MHATokenToKVPool(tokens, page, dtype, heads, head_dim, layers, "cpu", False, start_layer=0,
                           end_layer=layers)
    info = dev.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info)(
        info, **common,
        device_capacity_tokens=dev.size if dev.host_capacity_tokens is None else dev.host_capacity_tokens,
        start_layer=dev.start_layer, end_layer=dev.end_layer, write_back_staging=dev.hicache_write_back_staging)


def storage_config(extra: dict[str, Any], *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   pp_size: int = 1, layout: str = "page_first", model: str = "test/model") -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=pp_size, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=layout != "layer_first", model_name=model,
                                extra_config={**BACKEND, **extra})


def make_backend(pool: Any, extra: dict[str, Any], **kw: Any) -> Any:
    """What SGLang's cache controller does (sglang/srt/managers/cache_controller.py,
    attach_storage_backend): the factory builds it, then the host pool is registered."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, layout=pool.layout, **kw), pool)
    backend.register_mem_pool_host(pool)
    return backend


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
