"""The reference engine in-process: prefix caching must never change a token."""

from __future__ import annotations

import numpy as np
import pytest

import tpusync
from tpusync.serving import codec
from tpusync.serving.engine import Engine
from tpusync.serving.model import ModelConfig

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
        assert params["remote_address"] == "127.0.0.1:9" and params["num_tokens"] == 100
        keys = [int(k, 16) for k in params["block_keys"]]
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
