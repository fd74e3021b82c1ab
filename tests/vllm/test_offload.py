"""Prefix offload (kv_both): an engine saves its prompts' KV in the pod's sidecar; a fresh engine
with an empty vLLM prefix cache loads it instead of computing it, and decodes the same tokens."""

from __future__ import annotations

import numpy as np

from harness.engines import delta, prompt
from harness.tinymodel import BLOCK_BYTES, BLOCK_SIZE
from tpusync.kv.keys import BlockHasher


def full_blocks(tokens: list[int]) -> int:
    return len(tokens) // BLOCK_SIZE


def loadable_blocks(tokens: list[int]) -> int:
    return (len(tokens) - 1) // BLOCK_SIZE  # the last prompt token is always computed


def test_a_fresh_engine_loads_the_prefix_another_engine_saved(cluster):
    p = prompt(1, 300)  # 9 full blocks and a partial one
    want = cluster.reference(p)
    before = cluster.a.stats()
    assert cluster.a.generate(p)["token_ids"] == want
    assert delta(cluster.a.stats(), before)["saved_blocks"] == full_blocks(p)

    before = cluster.b.stats()
    out = cluster.b.generate(p)
    d = delta(cluster.b.stats(), before)
    assert d["matched_tokens"] == loadable_blocks(p) * BLOCK_SIZE == 288
    assert d["loaded_blocks"] == loadable_blocks(p) and d["load_error_blocks"] == 0
    assert d["saved_blocks"] == 0  # every full block came from the store
    assert out["token_ids"] == want


def test_a_shared_prefix_loads_and_the_new_tail_is_saved(cluster):
    base = prompt(2, 260)
    cluster.a.generate(base)  # saves 8 blocks
    q = base[:160] + prompt(3, 150)  # 5 blocks in common, then new tokens
    before = cluster.b.stats()
    out = cluster.b.generate(q)
    d = delta(cluster.b.stats(), before)
    assert d["matched_tokens"] == 5 * BLOCK_SIZE
    assert d["saved_blocks"] == full_blocks(q) - 5
    assert out["token_ids"] == cluster.reference(q)


def test_the_store_extends_vllms_own_prefix_hit(cluster):
    t = prompt(4, 400)
    cluster.a.generate(t)  # 12 blocks in the store
    cluster.b.generate(t[:130])  # b's vLLM prefix cache now holds 4 of them
    before = cluster.b.stats()
    out = cluster.b.generate(t)
    d = delta(cluster.b.stats(), before)
    assert d["matched_tokens"] == (loadable_blocks(t) - 4) * BLOCK_SIZE  # only what vLLM lacks
    assert out["token_ids"] == cluster.reference(t)


def test_the_engine_computes_with_the_loaded_kv(cluster):
    """The control for the equalities above: a stored block of the right size but with other
    content changes the output, so the KV really comes from the store."""
    u = prompt(5, 300)
    cluster.a.generate(u)
    keys = BlockHasher(BLOCK_SIZE).keys(u)
    rng = np.random.default_rng(0)
    with cluster.store("s") as store:
        store.evict(keys[2:7])
        store.put(keys[2:7], [3 * rng.standard_normal(BLOCK_BYTES // 4).astype(np.float32) for _ in range(5)])
        before = cluster.b.stats()
        out = cluster.b.generate(u)
        assert delta(cluster.b.stats(), before)["loaded_blocks"] == loadable_blocks(u)
        assert out["token_ids"] != cluster.reference(u)
        store.evict(keys)


def test_the_in_process_store_serves_the_same_engine_after_a_prefix_cache_reset(cluster):
    p = prompt(6, 300)
    want = cluster.reference(p)
    assert cluster.local.generate(p)["token_ids"] == want
    cluster.local.call("reset_prefix_cache")
    before = cluster.local.stats()
    out = cluster.local.generate(p)
    assert delta(cluster.local.stats(), before)["matched_tokens"] == loadable_blocks(p) * BLOCK_SIZE
    assert out["token_ids"] == want


def test_a_fresh_host_loads_the_prefix_from_the_shared_tier(cluster):
    """Engines on two hosts whose sidecars share a tier (and dial no peer): what one saved, the
    other loads from the shared filesystem, and decodes the tokens of vLLM without a connector."""
    p = prompt(7, 300)
    want = cluster.reference(p)
    assert cluster.shared_a.generate(p)["token_ids"] == want
    with cluster.store("sh1") as store:
        store.flush()  # written through to the shared tier
    with cluster.store("sh2") as store:
        sidecar_before = store.stats()["hits_shared"]
    before = cluster.shared_b.stats()
    out = cluster.shared_b.generate(p)
    d = delta(cluster.shared_b.stats(), before)
    assert d["matched_tokens"] == loadable_blocks(p) * BLOCK_SIZE
    assert d["loaded_blocks"] == loadable_blocks(p) and d["load_error_blocks"] == 0
    with cluster.store("sh2") as store:
        assert store.stats()["hits_shared"] - sidecar_before >= loadable_blocks(p)
    assert out["token_ids"] == want
