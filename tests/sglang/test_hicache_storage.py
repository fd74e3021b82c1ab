"""tpusync as SGLang's HiCache L3 backend, against SGLang 0.5.23's real host pools, factory and
fault injector, over real tpusync sidecars (tests/sglang/conftest.py)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

from harness.polling import wait_for
from harness.sglang_pools import PAGE, make_backend, make_pool
from tests.sglang.conftest import BLOCK, MHA_LAYOUTS, MLA_LAYOUTS, fill, hashes, pages_of
from tpusync import KVStore, errors
from tpusync.engines.sglang.storage import TPUSyncHiCacheStorage

LAYOUTS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]


def _round_trip(pool_a, pool_b, backend_a, backend_b, n=6):
    keys = hashes(n)
    idx_a = fill(pool_a, n, seed=1)
    assert backend_a.batch_set_v1(keys, idx_a) == [True] * n
    pool_b.alloc(3 * PAGE)  # other positions than in pool A
    idx_b = pool_b.alloc(n * PAGE)
    assert backend_b.batch_exists(keys) == n
    assert backend_b.batch_get_v1(keys, idx_b) == [True] * n
    for want, got in zip(pages_of(pool_a, idx_a), pages_of(pool_b, idx_b)):
        assert torch.equal(want, got)
    return keys


def test_importing_tpusync_imports_neither_sglang_nor_torch():
    code = ("import sys, tpusync, tpusync.engines.sglang, tpusync.engines.sglang.keys, tpusync.engines.sglang.plan; "
            "bad = [m for m in ('sglang', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_factory_builds_it_from_the_extra_config(launch):
    host = launch("f")
    pool = make_pool("page_first")
    backend = make_backend(pool, {"control_socket": host.socket})
    assert isinstance(backend, TPUSyncHiCacheStorage)
    assert backend.mem_pool_host is pool
    backend.close()


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS, ids=[f"{k}-{v}" for k, v in LAYOUTS])
def test_bytes_round_trip_between_fresh_pools(launch, kind, layout):
    host = launch("rt")
    mla = kind == "mla"
    pool_a, pool_b = make_pool(layout, mla=mla), make_pool(layout, mla=mla)
    a = make_backend(pool_a, {"control_socket": host.socket}, mla=mla)
    b = make_backend(pool_b, {"control_socket": host.socket}, mla=mla)
    _round_trip(pool_a, pool_b, a, b)
    assert a.counters()["set_ok"] == 6 and b.counters()["get_ok"] == 6
    stats = b.get_stats()
    assert stats.prefetch_pgs == [6] and stats.tpusync["exists_hits"] == 6


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_parts_larger_than_a_block_are_chunked(launch, layout):
    host = launch("chunk", block_bytes=4096)  # a K part of these pools: 3 layers x 2048 bytes
    pool_a, pool_b = make_pool(layout, heads=4, head_dim=64), make_pool(layout, heads=4, head_dim=64)
    a = make_backend(pool_a, {"control_socket": host.socket})
    b = make_backend(pool_b, {"control_socket": host.socket})
    _round_trip(pool_a, pool_b, a, b)
    assert len(a._plan.slots) == 4  # k.0 k.1 v.0 v.1


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_generic_path_and_v1_store_the_same_blocks(launch, layout):
    host = launch("gen")
    pool_a, pool_b = make_pool(layout), make_pool(layout)
    a = make_backend(pool_a, {"control_socket": host.socket})
    b = make_backend(pool_b, {"control_socket": host.socket})
    keys = hashes(4)
    idx_a = fill(pool_a, 4, seed=2)
    # the cache controller's _generic_page_set: flat pages from get_data_page, then batch_set
    assert a.batch_set(keys[:2], [pool_a.get_data_page(int(idx_a[i * PAGE])) for i in range(2)])
    assert a.batch_set_v1(keys[2:], idx_a[2 * PAGE:]) == [True, True]
    idx_b = pool_b.alloc(4 * PAGE)
    assert b.batch_get_v1(keys[:2], idx_b[:2 * PAGE]) == [True, True]
    # _generic_page_get: dummy flat pages, then set_from_flat_data_page
    got = b.batch_get(keys[2:], [pool_b.get_dummy_flat_data_page() for _ in range(2)])
    assert all(t is not None for t in got)
    for i, t in enumerate(got):
        pool_b.set_from_flat_data_page(int(idx_b[(2 + i) * PAGE]), t)
    for want, have in zip(pages_of(pool_a, idx_a), pages_of(pool_b, idx_b)):
        assert torch.equal(want, have)
    assert b.exists(keys[0]) and not b.exists("absent")
    assert b.get("absent") is None


def test_batch_exists_counts_the_leading_run_across_gaps(launch):
    host = launch("gap")
    pool = make_pool("page_first")
    backend = make_backend(pool, {"control_socket": host.socket})
    keys = hashes(7)
    idx = fill(pool, 7)
    stored = [0, 1, 2, 4, 5]
    assert backend.batch_set_v1([keys[i] for i in stored],
                                torch.cat([idx[i * PAGE:(i + 1) * PAGE] for i in stored])) == [True] * 5
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[4:]) == 2
    assert backend.batch_exists(keys[3:]) == 0
    assert backend.batch_exists([]) == 0
    fresh = pool.alloc(7 * PAGE)
    assert backend.batch_get_v1(keys, fresh) == [True, True, True, False, True, True, False]


def test_tp_ranks_do_not_see_each_others_pages_but_mla_ranks_share_the_latent(launch):
    host = launch("tp")
    for mla in (False, True):
        pool0, pool1 = make_pool("page_first", mla=mla), make_pool("page_first", mla=mla)
        rank0 = make_backend(pool0, {"control_socket": host.socket}, mla=mla, tp_rank=0, tp_size=2)
        rank1 = make_backend(pool1, {"control_socket": host.socket}, mla=mla, tp_rank=1, tp_size=2)
        keys = hashes(3)
        assert rank0.batch_set_v1(keys, fill(pool0, 3)) == [True] * 3
        assert rank0.batch_exists(keys) == 3
        want = 3 if mla else 0  # MLA KV is replicated: SGLang writes it from one rank for all
        assert rank1.batch_exists(keys) == want
        assert rank1.batch_get_v1(keys, pool1.alloc(3 * PAGE)) == [bool(want)] * 3
    other_model = make_backend(make_pool("page_first"), {"control_socket": host.socket}, model="other/model")
    assert other_model.batch_exists(keys) == 0


def test_a_full_store_fails_the_set_without_raising(launch):
    host = launch("full", dram_bytes=8 * 16 << 10)  # 8 blocks
    client = KVStore.connect(f"unix://{host.socket}")
    filler = [(1 << 100) + i for i in range(8)]
    client.put(filler, [bytes(100)] * 8)
    client.pin(filler, for_host=True)  # DRAM full of pinned blocks: nothing can be evicted
    pool = make_pool("page_first")
    backend = make_backend(pool, {"control_socket": host.socket})
    keys = hashes(3)
    assert backend.batch_set_v1(keys, fill(pool, 3)) == [False] * 3
    assert backend.batch_exists(keys) == 0
    assert backend.counters()["errors.set.capacity"] == 1
    client.release(filler, for_host=True)
    assert backend.batch_set_v1(keys, fill(pool, 3)) == [True] * 3  # room again
    client.close()


def test_an_unreachable_store_is_a_miss_never_an_exception(tmp_path):
    pool = make_pool("layer_first")
    backend = make_backend(pool, {"control_socket": str(tmp_path / "absent.sock"), "reconnect_interval_s": 0})
    keys = hashes(2)
    idx = fill(pool, 2)
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, idx) == [False, False]
    assert backend.batch_get_v1(keys, idx) == [False, False]
    assert backend.batch_get(keys) == [None, None]
    assert backend.batch_set(keys, [pool.get_data_page(int(idx[0]))] * 2) is False
    assert backend.clear() is False
    assert sum(v for k, v in backend.counters().items() if k.startswith("errors.")) >= 5


BAD_EXTRA = [("peers", "10.0.0.2:7600"), ("peers", ["10.0.0.2"]), ("peers", [7600]), ("reconnect_interval_s", "x"),
             ("reconnect_interval_s", -1), ("model", 5), ("local", {"dram_bytes": "1G", "block_bytes": BLOCK}),
             ("local", {"dram_bytes": 1 << 20}), ("timeout_s", "x")]


@pytest.mark.parametrize(("name", "value"), BAD_EXTRA, ids=[f"{n}={v!r:.30}" for n, v in BAD_EXTRA])
def test_sglangs_factory_refuses_a_malformed_extra_config_naming_the_field(launch, name, value):
    """The extra config is the operator's (SGLang's command line, or an admin's attach): a
    malformed option fails the build, naming it, instead of a backend that misses on every call
    (`"peers": "10.0.0.2:7600"` was read as the peers "1", "0", ".", ...)."""
    host = launch("cfg")
    extra = {"control_socket": host.socket, name: value}
    if name == "timeout_s":
        extra = {"store_url": f"tpusync://{host.sidecar.address}", name: value}
    with pytest.raises(errors.InvalidArgumentError, match=rf"extra config {name}\b"):
        make_backend(make_pool("page_first"), extra)


def test_an_extra_config_key_no_one_reads_is_logged(launch, caplog):
    host = launch("cfg")
    with caplog.at_level(logging.WARNING, "tpusync.sglang.storage"):
        backend = make_backend(make_pool("page_first"), {"control_socket": host.socket, "peer": ["10.0.0.2:7600"]})
    assert any("peer" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    backend.close()


def test_wrong_host_indices_are_a_failure_not_an_exception(launch):
    host = launch("bad")
    pool = make_pool("page_first")
    backend = make_backend(pool, {"control_socket": host.socket})
    idx = fill(pool, 2)
    assert backend.batch_set_v1(hashes(3), idx) == [False] * 3  # 3 keys, 2 pages of indices


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_sglangs_own_fault_injection(launch, monkeypatch, layout):
    """SGLang's CI setting (sglang/srt/mem_cache/hicache_storage.py,
    _maybe_wrap_hicache_storage_failure_injector, wrapped by the factory): random failures and
    delays before every call. Whatever it drops, what the backend reports held is right."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    host = launch("fault")
    pool_a, pool_b = make_pool(layout), make_pool(layout)
    a = make_backend(pool_a, {"control_socket": host.socket})
    b = make_backend(pool_b, {"control_socket": host.socket})
    assert isinstance(a, HiCacheStorageFailureInjector)
    assert isinstance(a._backend, TPUSyncHiCacheStorage)
    outcomes = set()
    for _ in range(30):  # P(no injected failure in 30 sets) = 0.7**30, about 2e-5
        keys = hashes(4)
        idx_a = fill(pool_a, 4, seed=len(outcomes))
        ok = a.batch_set_v1(keys, idx_a)
        outcomes.add(all(ok))
        held = b.batch_exists(keys)
        assert held in (0, 4) or not all(ok)
        idx_b = pool_b.alloc(4 * PAGE)
        got = b.batch_get_v1(keys, idx_b)
        want_pages, got_pages = pages_of(pool_a, idx_a), pages_of(pool_b, idx_b)
        for i, loaded in enumerate(got):
            if loaded:
                assert torch.equal(want_pages[i], got_pages[i])
        pool_a.free(idx_a)
        pool_b.free(idx_b)
    assert outcomes == {True, False}  # both happened: injected failures and real stores
    a.close()
    b.close()


def test_a_restarted_sidecar_keeps_the_pages_and_the_backend_reconnects(launch):
    host = launch("restart")
    pool_a, pool_b = make_pool("layer_first"), make_pool("layer_first")
    extra = {"control_socket": host.socket, "reconnect_interval_s": 0}
    a = make_backend(pool_a, extra)
    keys = hashes(5)
    idx_a = fill(pool_a, 5)
    assert a.batch_set_v1(keys, idx_a) == [True] * 5
    assert host.sidecar.stop() == 0
    assert a.batch_exists(keys) == 0  # the sidecar is down: a miss, no exception
    assert a.batch_set_v1(hashes(1), idx_a[:PAGE]) == [False]
    again = launch("restart")  # the same pool file and control socket
    assert again.pool_path == host.pool_path
    assert a.batch_exists(keys) == 5  # dialled again; the shared-memory pool survived
    b = make_backend(pool_b, extra)
    idx_b = pool_b.alloc(5 * PAGE)
    assert b.batch_get_v1(keys, idx_b) == [True] * 5
    for want, got in zip(pages_of(pool_a, idx_a), pages_of(pool_b, idx_b)):
        assert torch.equal(want, got)
    assert a.counters()["connects"] == 2


def test_two_hosts_share_prefixes_through_their_sidecars(launch):
    """Host B misses what host A stored; its backend pulls it from A's sidecar over the data port
    (KVStore.read_remote through B's sidecar), and then serves it from B's own pool."""
    host_a, host_b = launch("a"), launch("b")
    pool_a, pool_b = make_pool("page_first"), make_pool("page_first")
    a = make_backend(pool_a, {"control_socket": host_a.socket})
    b = make_backend(pool_b, {"control_socket": host_b.socket, "peers": [host_a.sidecar.address]})
    alone = make_backend(make_pool("page_first"), {"control_socket": host_b.socket})
    keys = _round_trip(pool_a, pool_b, a, b)
    assert b.counters()["peer_pages"] == 6
    assert alone.batch_exists(keys) == 6  # now in B's own pool
    more = hashes(2)
    assert a.batch_set_v1(more, fill(pool_a, 2)) == [True, True]
    assert alone.batch_exists(keys + more) == 6  # without peers, only what B holds


def test_the_shared_tier_serves_another_hosts_pages(launch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    kw = {"shared_dir": str(shared), "shared_layout": "sglang-test", "peers": []}
    host_a, host_b = launch("sa", **kw), launch("sb", **kw)
    pool_a, pool_b = make_pool("page_first_direct"), make_pool("page_first_direct")
    a = make_backend(pool_a, {"control_socket": host_a.socket})
    b = make_backend(pool_b, {"control_socket": host_b.socket})
    keys = hashes(4)
    idx_a = fill(pool_a, 4)
    assert a.batch_set_v1(keys, idx_a) == [True] * 4
    wait_for("B to find A's pages on the shared tier", lambda: b.batch_exists(keys) == 4, timeout=30)
    idx_b = pool_b.alloc(4 * PAGE)
    assert b.batch_get_v1(keys, idx_b) == [True] * 4
    for want, got in zip(pages_of(pool_a, idx_a), pages_of(pool_b, idx_b)):
        assert torch.equal(want, got)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_local_store_and_a_data_port(launch, secret_file, tmp_path, layout):
    pool_a, pool_b = make_pool(layout), make_pool(layout)
    local = make_backend(pool_a, {"local": {"dram_bytes": 4 << 20, "block_bytes": 16 << 10}})
    keys, idx_a = hashes(3), fill(pool_a, 3)
    assert local.batch_set_v1(keys, idx_a) == [True] * 3
    local.register_mem_pool_host(pool_b)  # the same store, read into another pool
    idx_b = pool_b.alloc(3 * PAGE)
    assert local.batch_get_v1(keys, idx_b) == [True] * 3
    for want, got in zip(pages_of(pool_a, idx_a), pages_of(pool_b, idx_b)):
        assert torch.equal(want, got)
    local.close()
    pool_b = make_pool(layout)
    host = launch("dp")
    port = {"store_url": f"tpusync://{host.sidecar.address}", "secret_file": secret_file}
    writer = make_backend(pool_a, port)
    reader = make_backend(pool_b, {"control_socket": host.socket})
    _round_trip(pool_a, pool_b, writer, reader)
    pool_c = make_pool(layout)
    back = make_backend(pool_c, port)  # and read back over the data port
    _round_trip(pool_b, pool_c, reader, back)
