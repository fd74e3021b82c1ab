"""The reference engine in-process: prefix caching must never change a token."""

from __future__ import annotations

import numpy as np
import pytest

import tpusync
from tpusync.engines.reference import codec
from tpusync.engines.reference.engine import Engine
from tpusync.engines.reference.model import ModelConfig
from tpusync.kv.handoff import kv_layout
from tpusync.kv.keys import BlockHasher

CFG = ModelConfig(max_seq=1024, layers=2, d_model=128, mlp=256)


def block_bytes(cfg: ModelConfig) -> int:
    return -(-cfg.page_bytes // 4096) * 4096


@pytest.fixture(scope="module")
def mono():
    return Engine(CFG, role="both")


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, CFG.vocab, n).tolist()


@pytest.mark.parametrize("n", [1, 31, 32, 127, 128, 129, 400, 512])
def test_prefix_hits_give_the_tokens_of_a_full_recompute(mono, n):
    want = mono.generate(prompt(n, n), 12).tokens
    assert len(set(want)) > 1  # the model is not stuck on one token: equality below means something
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG)) as store:
        cached = Engine(CFG, role="both", store=store)
        first = cached.generate(prompt(n, n), 12)
        again = cached.generate(prompt(n, n), 12)
    assert first.tokens == want and again.tokens == want
    assert first.stats.cached_tokens == 0
    full_pages = n // CFG.page_size
    assert again.stats.cached_tokens == min(full_pages * CFG.page_size, n - 1) // CFG.chunk * CFG.chunk


def test_shared_prefix_computes_only_the_new_part(mono):
    base = prompt(1, 300)
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG)) as store:
        e = Engine(CFG, role="both", store=store)
        e.generate(base + prompt(2, 50), 4)
        r = e.generate(base + prompt(3, 90), 4)
    assert r.stats.cached_tokens == 256  # 9 full shared pages -> resume at chunk 256
    assert r.tokens == mono.generate(base + prompt(3, 90), 4).tokens


def test_a_dead_store_means_recompute_not_wrong_tokens(mono):
    p = prompt(5, 300)
    store = tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG))
    e = Engine(CFG, role="both", store=store)
    e.generate(p, 4)
    store.close()  # the sidecar is gone
    r = e.generate(p, 8)
    assert r.tokens == mono.generate(p, 8).tokens
    assert r.stats.cached_tokens == 0 and "closed" in r.stats.store_error


def test_a_dead_peer_keeps_the_local_prefix_hit(mono):
    """The peer tier failing must not throw away what this host's own tiers hold."""
    base = prompt(1, 300)
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG), secret=b"s" * 32) as store:
        e = Engine(CFG, role="both", store=store, peers=["127.0.0.1:1"])  # nothing listens there
        e.generate(base + prompt(2, 50), 4)
        r = e.generate(base + prompt(3, 90), 4)
    assert r.stats.cached_tokens == 256 and r.stats.store_error
    assert r.tokens == mono.generate(base + prompt(3, 90), 4).tokens


def test_prefill_role_returns_one_token_and_transfer_params():
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG)) as store:
        e = Engine(CFG, role="prefill", store=store, data_address="127.0.0.1:9")
        r = e.generate(prompt(7, 100), 10)
        assert len(r.tokens) == 1
        params = r.kv_transfer_params
        # The contract's producer, vLLM's dialect: what vLLM's and tpu-inference's decode engines read.
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 9)
        assert params["remote_num_tokens"] == 96 and params["tpusync_block_size"] == 32
        keys = keys_of(prompt(7, 100))
        assert params["tpusync_last_key"] == f"{keys[-1]:032x}"
        assert params["tpusync_kv_layout"] == kv_layout(model="tpusync/reference", layers=CFG.layers,
                                                        kv_heads=CFG.kv_heads, head_size=CFG.head_dim,
                                                        dtype=CFG.dtype, shards=1, format="k-v")
        assert len(keys) == 3 and store.lookup(keys).prefix_len == 3


@pytest.mark.parametrize("bad, message", [([], "empty"), ([300], "token ids"), ([1] * 1020, "exceeds max_seq")])
def test_bad_requests(mono, bad, message):
    with pytest.raises(tpusync.InvalidArgumentError, match=message):
        mono.generate(bad, 8)


def test_store_blocks_must_hold_a_page():
    with tpusync.KVStore.local(dram_bytes=1 << 20, block_bytes=4096) as store, pytest.raises(ValueError, match="page"):
        Engine(CFG, store=store)


def test_codec_is_reversible():
    text = "héllo \x00\xff wörld"
    assert codec.decode(codec.encode(text)) == text
    assert codec.encode("€") == list("€".encode())


def keys_of(tokens: list[int]) -> list[int]:
    """The block keys the engine stores a prompt's pages under."""
    return BlockHasher(CFG.page_size, "tpusync").keys(tokens)


def record_reads(store: tpusync.KVStore) -> list[str]:
    """Replaces the store's read_remote with one that records the peers asked and pulls nothing."""
    asked: list[str] = []

    def read_remote(peer: str, keys: list[int]) -> list[bool]:
        asked.append(peer)
        return [False] * len(keys)

    store.read_remote = read_remote
    return asked


def test_a_block_of_the_wrong_length_is_recomputed_and_replaced(mono):
    """A short block under the first key, a long one in mid-prefix: both are misses, the pages
    computed instead are stored in their place, and every run gives a cold run's tokens."""
    p, q = prompt(11, 300), prompt(12, 300)
    keys_p, keys_q = keys_of(p), keys_of(q)
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG) + 4096) as store:
        e = Engine(CFG, role="both", store=store)
        store.put([keys_p[0]], [np.ones(100, np.uint8)])
        store.put([keys_q[5]], [np.ones(CFG.page_bytes + 8, np.uint8)])
        runs = [e.generate(p, 8), e.generate(p, 8), e.generate(q, 8), e.generate(q, 8), e.generate(q, 8)]
        with store.acquire_many([keys_p[0], keys_q[5]]) as views:
            assert [len(v) for v in views] == [CFG.page_bytes, CFG.page_bytes]
    want_p, want_q = mono.generate(p, 8).tokens, mono.generate(q, 8).tokens
    assert [r.tokens for r in runs] == [want_p, want_p, want_q, want_q, want_q]
    # p: the short first block was a miss, then the page computed instead was a hit. q: its
    # first run stored pages 0-4 around the long block 5, the second loaded 0-4 (resuming at
    # chunk 128) and replaced 5, the third loaded all 9 (resuming at chunk 256).
    assert [r.stats.cached_tokens for r in runs] == [0, 256, 0, 128, 256]
    assert all(r.stats.as_dict()["prefix_cache"] == "ok" for r in runs)


def test_a_peers_error_text_is_not_in_the_stats_a_client_gets(mono):
    p = prompt(13, 200)
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG), secret=b"s" * 32) as store:
        e = Engine(CFG, role="both", store=store)
        r = e.generate(p, 4, kv_transfer_params=remote("127.0.0.1", 1))  # nothing listens there
    assert r.tokens == mono.generate(p, 4).tokens
    assert "127.0.0.1:1" in r.stats.store_error  # in-process callers (and the log) still see why
    public = r.stats.as_dict()
    assert public["prefix_cache"] == "unavailable" and "store_error" not in public
    assert "127.0.0.1" not in repr(public)


def remote(host: object, port: object, **more: object) -> dict:
    """kv_transfer_params naming a remote prefill (the contract's dialect)."""
    return {"do_remote_prefill": True, "remote_host": host, "remote_port": port, **more}


@pytest.mark.parametrize(("host", "port", "field"), [
    ("127.0.0.1\nX", 1, "remote_host"), ("a" * 300, 1, "remote_host"), ("127.0.0.1:1", 1, "remote_host"),
    ("[::1]x", 1, "remote_host"), (7, 1, "remote_host"), (["127.0.0.1"], 1, "remote_host"),
    ("decode-0.pool.svc", 9400, "remote_host"), ("localhost", 9400, "remote_host"), ("127.0.0.1", 0, "remote_port"),
    ("127.0.0.1", 65536, "remote_port"), ("127.0.0.1", "1", "remote_port"), ("127.0.0.1", None, "remote_port"),
    (None, None, None)])
def test_a_malformed_remote_address_is_never_passed_to_the_store(mono, host, port, field, caplog):
    """Nor is a name: the sidecar would resolve a host of the client's choosing."""
    p = prompt(14, 100)
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG), secret=b"s" * 32) as store:
        asked = record_reads(store)
        e = Engine(CFG, role="both", store=store)
        r = e.generate(p, 4, kv_transfer_params=remote(host, port), request_id="cmpl-t")
    assert asked == [] and r.stats.store_error == "" and r.tokens == mono.generate(p, 4).tokens
    refusals = [r.getMessage() for r in caplog.records if "kv_transfer_params.remote_" in r.getMessage()]
    if field is not None:  # absent is not malformed
        assert len(refusals) == 1 and "cmpl-t" in refusals[0] and f"kv_transfer_params.{field}" in refusals[0]
    else:
        assert refusals == []


@pytest.mark.parametrize(("host", "asked"), [
    ("127.0.0.1", "127.0.0.1:9400"), ("10.0.0.5", "10.0.0.5:9400"), ("fd00::5", "[fd00::5]:9400"),
    ("[fd00::5]", "[fd00::5]:9400")])
def test_a_well_formed_remote_address_is_asked(host, asked):
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG), secret=b"s" * 32) as store:
        seen = record_reads(store)
        e = Engine(CFG, role="both", store=store)
        e.generate(prompt(15, 100), 1, kv_transfer_params=remote(host, 9400))
    assert seen == [asked]


# ModelConfig()'s pages split in two, as a two-host prefill says
LAYOUT = {**kv_layout(model="tpusync/reference", layers=4, kv_heads=2, head_size=64, dtype="float32", shards=2,
                      format="k-v"),
          "hosts": [[0], [1]]}


@pytest.mark.parametrize(("change", "message"), [
    ({"head_size": 128}, "head_size 128, here 64"),
    ({"dtype": "bfloat16"}, "dtype 'bfloat16', here 'float32'"),
    ({"model": "org/other"}, "model 'org/other'"),
    ({"format": "vllm-torch"}, "format 'vllm-torch', here 'k-v'"),  # a vLLM prefill of this geometry
    ({"layers": None}, "layers None, here 4"),
    ({"shards": 3}, "do not split"),
    ({"shards": 4}, "do not split"),  # more shards than kv heads
    ({"tpusync_block_size": 8192}, "blocks of 8192 tokens"),
])
def test_a_prefill_layout_that_is_not_this_models_pages_is_not_pulled(change, message, caplog):
    """The contract's layout check (tpusync.kv.handoff.layout_refusal): nothing is pulled from the
    prefill, the prompt is computed."""
    cfg = ModelConfig(max_seq=1024)
    layout = {k: v for k, v in {**LAYOUT, **change}.items() if v is not None and k != "tpusync_block_size"}
    params = remote("10.0.0.1", 7600, tpusync_kv_layout=layout,
                    tpusync_block_size=change.get("tpusync_block_size", 32))
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(cfg), secret=b"s" * 32) as store:
        asked = record_reads(store)
        Engine(cfg, role="both", store=store).generate(prompt(16, 100), 1, kv_transfer_params=params)
    assert asked == []
    assert "not pulling the prefill's KV" in caplog.text and message in caplog.text


@pytest.mark.parametrize("change", [{"shards": 0}, {"shards": True}, {"shards": "2"}, {"hosts": [[0], [7]]},
                                    {"head_size": "64"}])
def test_a_malformed_prefill_layout_refuses_the_hand_off(mono, change, caplog):
    """Not a layout at all (tpusync.kv.handoff): nothing is pulled, the prompt is computed."""
    p = prompt(16, 100)
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG), secret=b"s" * 32) as store:
        asked = record_reads(store)
        r = Engine(CFG, role="both", store=store).generate(
            p, 4, kv_transfer_params=remote("10.0.0.1", 7600, tpusync_kv_layout={**LAYOUT, **change}))
    assert asked == [] and r.tokens == mono.generate(p, 4).tokens
    [name] = change
    assert f"kv_transfer_params.tpusync_kv_layout.{name}" in caplog.text


def test_a_prefill_that_keyed_the_prompt_otherwise_is_not_pulled(caplog):
    p = prompt(17, 100)
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG), secret=b"s" * 32) as store:
        asked = record_reads(store)
        Engine(CFG, role="both", store=store).generate(
            p, 1, kv_transfer_params=remote("10.0.0.1", 7600, remote_num_tokens=96, tpusync_last_key="ab" * 16))
    assert asked == [] and "keyed this prompt differently" in caplog.text
