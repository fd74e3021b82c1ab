"""Prefill and decode engines of different tensor parallelism and page size, real tpu-inference
engines over real sidecars: one engine on one XLA host device (its KV cache whole), two on two
(each layer's cache split on the `model` axis, one KV head per device), one of them with pages of
16 tokens instead of 32. Each is the prefill for the others. The prefill tells its KV layout in
kv_transfer_params (`tpusync_kv_layout`: model, layers, heads, head size, dtype, and the parts it
stores a block in) and its block size; the decode engine pulls the blocks in those parts and
sizes, and each of its shards loads the head and token ranges it owns
(`tpusync.kv.pages.load_pages_resharded`). Tokens equal HF transformers' every way; a
prefill whose layout differs in anything but its split is refused and the prompt recomputed."""

from __future__ import annotations

import pytest

from harness.engines import delta, prompt

TOKENS = 288  # the full 32- and 16-token blocks of a 300-token prompt
BLOCK_SIZE = {"tp1": 32, "tp2": 32, "tp2-p16": 16}


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    """tp1, tp2 and tp2-p16, each kv_both (saves as a prefill, pulls as a decode) on a sidecar of its own."""
    from harness.tinymodel import BLOCK_BYTES
    from harness.tpu_engines import EngineSpec, Pods, TpuEngine, rendered_kv_transfer_config

    pods = Pods(tmp_path_factory.mktemp("hetero-tp"), "hetero-tp")
    try:
        engines = {}
        for name, tp in (("tp1", 1), ("tp2", 2), ("tp2-p16", 2)):
            car = pods.sidecar(name, dram_bytes=32 << 20, block_bytes=BLOCK_BYTES)
            kv = rendered_kv_transfer_config("tpusync", "decode", kv_role="kv_both", control_socket=car.control_socket,
                                             data_address=car.address)
            engines[name] = TpuEngine(f"hetero-{name}", EngineSpec(str(model_dir), pods.work, kv),
                                      tensor_parallel_size=tp, block_size=BLOCK_SIZE[name])
        pods.start(**engines)
        yield pods.engines
    finally:
        pods.close()


def prefill(engine, p: list[int]) -> dict:
    params = engine.generate(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert params["remote_num_tokens"] == TOKENS
    del params["remote_prefill_cached_tokens"]  # else vLLM reports the prefill's hits as the decode's
    return params


@pytest.mark.parametrize("src,dst", [("tp1", "tp2"), ("tp2", "tp1")])
def test_decode_loads_a_prefill_of_another_tensor_parallelism(engines, reference, src, dst):
    p = prompt(71 if src == "tp1" else 72, 300)
    params = prefill(engines[src], p)
    assert params["tpusync_kv_layout"]["shards"] == (1 if src == "tp1" else 2)
    before = engines[dst].stats()
    got = engines[dst].generate(p, max_tokens=16, kv_transfer_params=params)
    d = delta(engines[dst].stats(), before)
    assert d["pulled_blocks"] == TOKENS // 32 and d["loaded_blocks"] == TOKENS // 32, d
    assert d["load_error_blocks"] == 0, d
    assert got["num_cached_tokens"] == TOKENS
    assert got["token_ids"] == reference(p)


@pytest.mark.parametrize("seed,src,dst", [(73, "tp1", "tp2-p16"), (74, "tp2-p16", "tp1"), (75, "tp2", "tp2-p16"),
                                          (76, "tp2-p16", "tp2")])
def test_decode_loads_a_prefill_of_another_page_size(engines, reference, seed, src, dst):
    """Two 16-token blocks make a 32-token page, half a 32-token block a 16-token page; with the
    split changing too (tp1 and tp2-p16) or not (tp2 and tp2-p16)."""
    p = prompt(seed, 300)
    params = prefill(engines[src], p)
    assert params["tpusync_block_size"] == BLOCK_SIZE[src]
    before = engines[dst].stats()
    got = engines[dst].generate(p, max_tokens=16, kv_transfer_params=params)
    d = delta(engines[dst].stats(), before)
    assert d["pulled_blocks"] == TOKENS // BLOCK_SIZE[src] and d["loaded_blocks"] == TOKENS // BLOCK_SIZE[dst], d
    assert d["load_error_blocks"] == 0 and d["refused_prefills"] == 0, d
    assert d["saved_blocks"] == TOKENS // BLOCK_SIZE[dst], d  # kv_both: kept under its own keys too
    assert got["num_cached_tokens"] == TOKENS
    assert got["token_ids"] == reference(p)


def test_a_decode_that_holds_the_start_loads_the_rest_from_inside_a_block(engines, reference):
    """The decode engine (16-token pages) computed the prompt's first 48 tokens already: it
    loads from token 48, the middle of the prefill's second 32-token block, and pulls only the
    blocks from there."""
    p = prompt(77, 300)
    engines["tp2-p16"].generate(p[:50], max_tokens=1)  # vLLM's own prefix cache: 3 pages of 16
    params = prefill(engines["tp1"], p)
    before = engines["tp2-p16"].stats()
    got = engines["tp2-p16"].generate(p, max_tokens=16, kv_transfer_params=params)
    d = delta(engines["tp2-p16"].stats(), before)
    assert d["pulled_blocks"] == TOKENS // 32 - 1 and d["loaded_blocks"] == TOKENS // 16 - 3, d
    assert d["load_error_blocks"] == 0, d
    assert got["num_cached_tokens"] == TOKENS
    assert got["token_ids"] == reference(p)


@pytest.mark.parametrize("seed,field,value", [(81, "model", "another/model"), (82, "kv_heads", 4),
                                              (83, "dtype", "bfloat16"), (84, "shards", 0)])
def test_a_prefill_of_another_layout_is_refused_and_recomputed(engines, reference, seed, field, value):
    p = prompt(seed, 300)
    params = prefill(engines["tp1"], p)
    params["tpusync_kv_layout"][field] = value
    before = engines["tp2"].stats()
    got = engines["tp2"].generate(p, max_tokens=16, kv_transfer_params=params)
    d = delta(engines["tp2"].stats(), before)
    assert d["refused_prefills"] == 1 and d["pulled_blocks"] == 0 and d["loaded_blocks"] == 0, d
    assert got["num_cached_tokens"] == 0
    assert got["token_ids"] == reference(p)
