"""SGLang's real HiCache host pools and tpusync's storage backend as SGLang builds them, on the
CPU: the SGLang tier (tests/sglang) and bench/sglang_bench.py use these. Host pools are built by
SGLang's own constructors from SGLang's own device pools (sglang 0.5.23:
sglang/srt/mem_cache/memory_pool.py MHATokenToKVPool / MLATokenToKVPool on device "cpu",
sglang/srt/mem_cache/pool_host/mha.py MHATokenToKVPoolHost via get_mha_host_pool_cls,
pool_host/mla.py MLATokenToKVPoolHost, with the arguments
sglang/srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py::_build_mha_mla_host_pool passes), and
the backend by SGLang's StorageBackendFactory from the extra config, as
`--hicache-storage-backend dynamic` does. SGLang and torch are imported when called: they exist
only in the SGLang tier's environment.
"""

from __future__ import annotations

from typing import Any

# The default pool: small, for tests (a bench passes its own shape).
PAGE = 4          # tokens per page
LAYERS = 3
HEADS = 2
HEAD_DIM = 16
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
