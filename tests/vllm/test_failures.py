"""Store and peer failures never fail a request or the engine: what cannot be loaded is computed,
and the output is exactly that of vLLM without a connector."""

from __future__ import annotations

import numpy as np

from harness.engines import delta, prompt
from harness.tinymodel import BLOCK_BYTES, BLOCK_SIZE
from tpusync.kv.keys import BlockHasher


def remote(peer_port: int, tokens: int, **extra) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1",
            "remote_port": peer_port, "remote_num_tokens": tokens, "tpusync_block_size": BLOCK_SIZE, **extra}


def test_a_dead_prefill_peer_means_recompute(cluster):
    dead = cluster.launch("dead")
    dead.kill()
    p = prompt(20, 300)
    before = cluster.decode.stats()
    out = cluster.decode.generate(p, kv_transfer_params=remote(dead.data_port, 288))
    d = delta(cluster.decode.stats(), before)
    assert d["peer_errors"] == 1 and d["pulled_blocks"] == 0 and d["matched_tokens"] == 0
    assert out["token_ids"] == cluster.reference(p)


def test_a_peer_without_the_blocks_means_recompute(cluster):
    p = prompt(21, 300)
    before = cluster.decode.stats()
    out = cluster.decode.generate(p, kv_transfer_params=remote(cluster.empty.data_port, 288))
    d = delta(cluster.decode.stats(), before)
    assert d["peer_errors"] == 0 and d["pulled_blocks"] == 0 and d["matched_tokens"] == 0
    assert out["token_ids"] == cluster.reference(p)


def test_params_from_an_engine_that_hashed_differently_are_ignored(cluster):
    p = prompt(22, 300)
    cluster.prefill.generate(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    before = cluster.decode.stats()
    out = cluster.decode.generate(p, kv_transfer_params=remote(cluster.p.data_port, 288,
                                                               tpusync_last_key="00" * 16))
    d = delta(cluster.decode.stats(), before)
    assert d["pulled_blocks"] == 0 and d["matched_tokens"] == 0
    assert out["token_ids"] == cluster.reference(p)


def test_a_block_that_cannot_be_loaded_is_recomputed_and_stored_again(cluster):
    p = prompt(23, 300)
    cluster.a.generate(p)  # 9 blocks in sidecar s
    keys = BlockHasher(BLOCK_SIZE).keys(p)
    with cluster.store("s") as store:
        store.evict(keys[3:4])
        store.put(keys[3:4], [np.zeros(1000, np.uint8)])  # a block of another size under block 3's key
        before = cluster.b.stats()
        out = cluster.b.generate(p)
        d = delta(cluster.b.stats(), before)
        assert d["matched_tokens"] == 9 * BLOCK_SIZE  # offered: the lookup cannot tell
        assert d["loaded_blocks"] == 3 and d["load_error_blocks"] == 6
        assert out["token_ids"] == cluster.reference(p)
        # b stored the recomputed block in place of the bad one
        assert d["saved_blocks"] == 1
        with store.acquire_many(keys[3:4]) as views:
            assert len(views[0]) == BLOCK_BYTES


def test_the_engine_outlives_its_sidecar_and_reconnects(cluster):
    p, q = prompt(24, 300), prompt(25, 300)
    assert cluster.fragile.generate(p)["token_ids"] == cluster.reference(p)  # saved to sidecar f
    cluster.f.kill()
    before = cluster.fragile.stats()
    out = cluster.fragile.generate(q)
    d = delta(cluster.fragile.stats(), before)
    assert d["store_errors"] >= 1 and d["saved_blocks"] == 0
    assert out["token_ids"] == cluster.reference(q)

    cluster.launch("f")  # a restart re-attaches the shared-memory pool: p's blocks survived
    cluster.fragile.call("reset_prefix_cache")
    before = cluster.fragile.stats()
    out = cluster.fragile.generate(p)
    d = delta(cluster.fragile.stats(), before)
    assert d["matched_tokens"] == 9 * BLOCK_SIZE
    assert out["token_ids"] == cluster.reference(p)
