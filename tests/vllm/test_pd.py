"""Disaggregated prefill/decode: a kv_producer engine computes the prompt into its pod's sidecar;
a kv_consumer engine, handed the kv_transfer_params, has its own sidecar pull the blocks from
the prefill pod's sidecar and decodes exactly what one engine alone would."""

from __future__ import annotations

from harness.engines import delta, prompt
from harness.tinymodel import BLOCK_SIZE

PREFILL_PARAMS = {"do_remote_decode": True}  # what a P/D proxy sends the prefill engine


def test_decode_pulls_the_prompt_from_the_prefill_sidecar(cluster):
    p = prompt(10, 330)  # 10 full blocks
    want = cluster.reference(p)
    first = cluster.prefill.generate(p, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)
    assert first["token_ids"] == want[:1]
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", cluster.p.data_port)
    assert params["remote_num_tokens"] == 10 * BLOCK_SIZE and params["tpusync_block_size"] == BLOCK_SIZE

    before = cluster.decode.stats()
    out = cluster.decode.generate(p, kv_transfer_params=params)
    d = delta(cluster.decode.stats(), before)
    assert d["pulled_blocks"] == 10 and d["matched_tokens"] == 10 * BLOCK_SIZE and d["peer_errors"] == 0
    assert d["loaded_blocks"] == 10 and d["load_error_blocks"] == 0  # layer by layer, on the loader thread
    assert d["saved_blocks"] == 0  # a consumer only loads
    assert out["token_ids"] == want


def test_decode_pulls_only_the_blocks_it_lacks(cluster):
    shared = prompt(11, 200)
    cluster.decode.generate(shared, kv_transfer_params=cluster.prefill.generate(
        shared, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)["kv_transfer_params"])
    q = shared + prompt(12, 140)  # 6 blocks in common, 4 new full blocks
    params = cluster.prefill.generate(q, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)["kv_transfer_params"]
    before = cluster.decode.stats()
    out = cluster.decode.generate(q, kv_transfer_params=params)
    d = delta(cluster.decode.stats(), before)
    assert d["pulled_blocks"] == 4 and d["matched_tokens"] == 4 * BLOCK_SIZE  # vLLM's cache has the rest
    assert out["token_ids"] == cluster.reference(q)


def test_a_request_without_params_is_served_from_the_decode_sidecar(cluster):
    """Blocks pulled for one request stay in the decode pod's sidecar for the next ones."""
    p = prompt(13, 300)
    params = cluster.prefill.generate(p, max_tokens=1, kv_transfer_params=PREFILL_PARAMS)["kv_transfer_params"]
    cluster.decode.generate(p, max_tokens=1, kv_transfer_params=params)
    cluster.decode.call("reset_prefix_cache")
    before = cluster.decode.stats()
    out = cluster.decode.generate(p)
    d = delta(cluster.decode.stats(), before)
    assert d["pulled_blocks"] == 0 and d["matched_tokens"] == 9 * BLOCK_SIZE
    assert out["token_ids"] == cluster.reference(p)
