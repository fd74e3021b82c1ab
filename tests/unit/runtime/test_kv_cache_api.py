"""PrefixStore / PageMover: tpusync's own engine-facing KV-cache API (upstream's names are
tpusync.engines.upstream's)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import tpusync
from tpusync import TransferStatus
from tpusync.kv.cache import PageMover, PrefixStore

SHAPE = (2, 8, 4, 2, 8)
BLOCK = 4096


@pytest.fixture
def store():
    with tpusync.KVStore.local(dram_bytes=64 * BLOCK, block_bytes=BLOCK) as s:
        yield s


def test_lookup_pins_until_a_load_consumes_them(store):
    kvs = PrefixStore(store)
    data = [np.full(BLOCK, i, np.uint8) for i in range(3)]
    kvs.insert([1, 2, 3], data)
    assert kvs.lookup([1, 2, 3, 4], pin_found=True) == 3
    assert store.stats()["pinned"] == 3
    out = [np.zeros(BLOCK, np.uint8) for _ in range(2)]
    h = kvs.load([1, 2], out)
    h.result(10)
    assert kvs.poll_load_status(h) is TransferStatus.DONE
    assert [o[0] for o in out] == [0, 1]
    assert store.stats()["pinned"] == 1  # the load consumed two pins
    kvs.release([3])
    assert store.stats()["pinned"] == 0
    kvs.close()


def test_failed_load_keeps_pins_and_reports_failed(store):
    kvs = PrefixStore(store)
    kvs.insert([1], [np.ones(BLOCK, np.uint8)])
    kvs.lookup([1], pin_found=True)
    h = kvs.load([1, 99], [np.zeros(BLOCK, np.uint8)] * 2)
    with pytest.raises(tpusync.NotFoundError):
        h.result(10)
    assert kvs.poll_load_status(h) is TransferStatus.FAILED
    assert store.stats()["pinned"] == 1
    kvs.close()


def test_save_is_asynchronous_and_polled(store):
    kvs = PrefixStore(store)
    h = kvs.save([5, 6], [np.ones(BLOCK, np.uint8)] * 2)
    h.result(10)
    assert kvs.poll_save_status(h) is TransferStatus.DONE
    assert kvs.lookup([5, 6]) == 2
    kvs.close()


def test_manager_moves_device_pages_both_ways(store):
    k = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE)
    m = PageMover(store, k, -k)
    m.d2h([1, 2], [11, 12], request_id="r1").result(10)
    assert m.poll_stats() == ({"r1"}, set(), set())
    m2 = PageMover(store, jnp.zeros(SHAPE), jnp.zeros(SHAPE))
    assert m2.h2d([5, 6, 7], [11, 12, 13], request_id="r2").result(10) == 2
    assert m2.poll_stats() == (set(), set(), {"r2"})  # block 13 was never saved
    assert np.array_equal(np.asarray(m2.k[:, 5]), np.asarray(k[:, 1]))
    assert np.array_equal(np.asarray(m2.v[:, 6]), -np.asarray(k[:, 2]))
    m2.lock_blocks([11])
    assert store.stats()["pinned"] == 1
    m2.unlock_blocks([11, 999])
    assert store.stats()["pinned"] == 0
    m.close()
    m2.close()


def test_start_read_without_register_is_an_error(store):
    m = PageMover(store, jnp.zeros(SHAPE), jnp.zeros(SHAPE))
    with pytest.raises(tpusync.NotFoundError):
        m.start_read("nope")
    with pytest.raises(tpusync.InvalidArgumentError):
        m.register_read("r", "127.0.0.1:1", [1, 2], [0])
    m.close()
