"""The page plan and the key scheme of tpusync.engines.sglang, against SGLang's real HiCacheStorageConfig."""

from __future__ import annotations

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from harness.sglang_pools import HEAD_DIM, HEADS, LAYERS, PAGE, make_pool
from tpusync.engines.sglang.keys import KeyScope, block_keys, block_scope
from tpusync.engines.sglang.plan import PagePlan, Segment


def _config(**kw) -> HiCacheStorageConfig:
    base = {"tp_rank": 0, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
            "is_mla_model": False, "enable_storage_metrics": False, "is_page_first_layout": True, "model_name": "m"}
    return HiCacheStorageConfig(**{**base, **kw})


def test_mha_pages_split_into_k_and_v_and_chunks():
    plan = PagePlan([100, 100, 100, 100, 100, 100], mla=False, chunk_bytes=250)  # layer_first, 3 layers
    assert plan.slots == ("k.0", "k.1", "v.0", "v.1")
    assert plan.chunks[0].segments == (Segment(0, 0, 100), Segment(2, 0, 100), Segment(4, 0, 50))
    assert plan.chunks[1].segments == (Segment(4, 50, 50),)
    assert [c.flat_offset for c in plan.chunks] == [0, 250, 300, 550]
    assert plan.page_bytes == 600 and not plan.direct
    direct = PagePlan([300, 300], mla=False, chunk_bytes=4096)  # page_first: K, V
    assert direct.slots == ("k.0", "v.0") and direct.direct


def test_mla_pages_are_one_latent():
    plan = PagePlan([64, 64, 64], mla=True, chunk_bytes=4096)
    assert plan.slots == ("latent.0",) and plan.chunks[0].nbytes == 192


def test_keys_separate_ranks_models_pools_and_slots_but_not_mla_tp_ranks():
    import torch

    def ns(pool=None, **kw):
        over = {k: kw.pop(k) for k in list(kw) if k in ("geometry", "chunk_bytes", "model")}
        mla = kw.get("is_mla_model", False)
        return KeyScope.from_config(_config(**kw), pool or make_pool("page_first", mla=mla), model=over.get("model"),
                                    geometry=over.get("geometry", "g"), chunk_bytes=over.get("chunk_bytes", 4096)
                                    ).namespace()

    base = ns()
    different = [ns(tp_rank=1), ns(dp_rank=1), ns(pp_rank=1, pp_size=2), ns(attn_cp_rank=1, attn_cp_size=2),
                 ns(model="other"), ns(make_pool("layer_first")), ns(geometry="h"), ns(chunk_bytes=8192),
                 ns(is_mla_model=True), ns(make_pool("page_first", dtype=torch.float16)),
                 ns(make_pool("page_first", layers=LAYERS + 1)), ns(make_pool("page_first", heads=HEADS * 2)),
                 ns(make_pool("page_first", page=PAGE * 2, tokens=512))]
    assert len({base, *different}) == len(different) + 1
    assert ns(is_mla_model=True, tp_rank=0) == ns(is_mla_model=True, tp_rank=1, dp_rank=3)
    keys = block_keys(base, ["h1", "h2"], ["k.0", "v.0"])
    assert len(set(keys)) == 4 and all(len(k) == 16 for k in keys)
    assert block_keys(base, ["h2"], ["k.0", "v.0"]) == keys[2:]


def test_the_scope_is_the_kv_planes_read_from_the_pool():
    """SGLang's keys derive from tpusync.kv's BlockScope, the one type of what makes block bytes differ."""
    mha = block_scope(make_pool("page_first"), model="m", mla=False, tp_size=2)
    assert (mha.layers, mha.kv_heads, mha.head_size, mha.page_tokens, mha.shards) == (LAYERS, HEADS, HEAD_DIM, PAGE, 2)
    assert mha.format == "sglang-page_first" and mha.dtype == "torch.bfloat16"
    mla = block_scope(make_pool("page_first", mla=True), model="m", mla=True, tp_size=2)
    assert (mla.kv_heads, mla.shards) == (1, 1) and mla.head_size > 0
    assert mha.identity().encode() in KeyScope(block=mha, mla=False).namespace()
