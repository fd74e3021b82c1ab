"""The reference engine in-process: prefix caching must never change a token."""

from __future__ import annotations

import numpy as np
import pytest

import tpusync
from tpusync.hashing import BlockHasher
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
        r = e.generate(p, 4, kv_transfer_params={"remote_address": "127.0.0.1:1"})  # nothing listens there
    assert r.tokens == mono.generate(p, 4).tokens
    assert "127.0.0.1:1" in r.stats.store_error  # in-process callers (and the log) still see why
    public = r.stats.as_dict()
    assert public["prefix_cache"] == "unavailable" and "store_error" not in public
    assert "127.0.0.1" not in repr(public)


@pytest.mark.parametrize("address", ["127.0.0.1:1\nX", "a" * 300 + ":1", "no-port", "h:0", "h:65536", "h:1:2", "h: 1",
                                     "[::1]x:1", 7, ["127.0.0.1:1"], "decode-0.pool.svc:9400", "localhost:9400",
                                     None, ""])
def test_a_malformed_remote_address_is_never_passed_to_the_store(mono, address, caplog):
    """Nor is a name: the sidecar would resolve a host of the client's choosing."""
    p = prompt(14, 100)
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG), secret=b"s" * 32) as store:
        asked = record_reads(store)
        e = Engine(CFG, role="both", store=store)
        r = e.generate(p, 4, kv_transfer_params={"remote_address": address}, request_id="cmpl-t")
    assert asked == [] and r.stats.store_error == "" and r.tokens == mono.generate(p, 4).tokens
    refusals = [r.getMessage() for r in caplog.records if "kv_transfer_params.remote_address" in r.getMessage()]
    if address not in (None, ""):  # absent is not malformed
        assert len(refusals) == 1 and "cmpl-t" in refusals[0], refusals
    else:
        assert refusals == []


@pytest.mark.parametrize(("address", "asked"), [
    ("127.0.0.1:9400", "127.0.0.1:9400"), ("tpusync://10.0.0.5:9400", "10.0.0.5:9400"),
    ("[fd00::5]:9400", "[fd00::5]:9400"), ("fd00::5:9400", "[fd00::5]:9400")])
def test_a_well_formed_remote_address_is_asked(address, asked):
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG), secret=b"s" * 32) as store:
        seen = record_reads(store)
        e = Engine(CFG, role="both", store=store)
        e.generate(prompt(15, 100), 1, kv_transfer_params={"remote_address": address})
    assert seen == [asked]


LAYOUT = {"shards": 2, "hosts": [[0], [1]], "layers": 4, "page_size": 32, "kv_heads": 2, "head_dim": 64,
          "dtype": "float32"}  # ModelConfig()'s pages split in two


@pytest.mark.parametrize(("change", "message"), [
    ({"head_dim": 128}, "not this model's"),
    ({"dtype": "bfloat16"}, "not this model's"),
    ({"page_size": 1 << 20}, "not a number of tokens"),
    ({"layers": None}, "not this model's"),
    ({"shards": 3}, "does not split"),
    ({"shards": 4}, "does not split"),  # more shards than kv heads
])
def test_a_prefill_layout_that_is_not_this_models_pages_is_refused(change, message):
    from tpusync.kv.handoff import reference_prefill
    from tpusync.serving.engine import prefill_layout

    with pytest.raises(tpusync.InvalidArgumentError, match=message):
        prefill_layout(reference_prefill({"layout": {**LAYOUT, **change}}), ModelConfig())
    assert prefill_layout(reference_prefill({}), ModelConfig()) is None


@pytest.mark.parametrize("change", [{"page_size": 0}, {"page_size": "16"}, {"shards": 0}, {"shards": True},
                                    {"shards": "2"}, {"hosts": [[0], [7]]}])
def test_a_malformed_prefill_layout_refuses_the_hand_off(mono, change, caplog):
    """Not a layout at all (tpusync.kv.handoff): nothing is pulled, the prompt is computed."""
    p = prompt(16, 100)
    with tpusync.KVStore.local(dram_bytes=8 << 20, block_bytes=block_bytes(CFG), secret=b"s" * 32) as store:
        asked = record_reads(store)
        r = Engine(CFG, role="both", store=store).generate(
            p, 4, kv_transfer_params={"remote_address": "10.0.0.1:7600", "layout": {**LAYOUT, **change}})
    assert asked == [] and r.tokens == mono.generate(p, 4).tokens
    [name] = change
    assert f"kv_transfer_params.layout.{name}" in caplog.text


def test_pulls_go_to_the_prefill_hosts_that_hold_the_needed_shards():
    from tpusync.kv.handoff import reference_prefill
    from tpusync.serving.engine import prefill_layout

    remote = reference_prefill({"layout": LAYOUT, "remote_addresses": ["10.0.0.1:7600", "10.0.0.2:7600"]})
    assert prefill_layout(remote, ModelConfig()) == (2, [[0], [1]], LAYOUT["page_size"])
    assert remote is not None
    assert remote.pulls([0, 1], 0) == [("10.0.0.1:7600", [0]), ("10.0.0.2:7600", [1])]
    assert remote.pulls([1], 0) == [("10.0.0.2:7600", [1])]
    # Hosts that do not say what they hold: every needed shard from each, this host's counterpart first.
    unsaid = reference_prefill({"layout": {k: v for k, v in LAYOUT.items() if k != "hosts"},
                                "remote_addresses": ["10.0.0.1:7600", "10.0.0.2:7600"]})
    assert unsaid is not None
    assert unsaid.pulls([0, 1], 1) == [("10.0.0.2:7600", [0, 1]), ("10.0.0.1:7600", [0, 1])]
