"""PrefixStore / PageMover over real sidecars: save with a push to a peer, remote
reads, and a registered read that pulls from a peer into device pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import tpusync
from tests.integration.conftest import BLOCK, engine
from tpusync import TransferStatus
from tpusync.kv.cache import PageMover, PrefixStore
from tpusync.kv.pages import save_pages

SHAPE = (2, 8, 16, 4, 128)  # layers, pages, page_size, kv_heads, head_dim: 64 KiB f32 per K/V page


def test_save_pushes_to_a_peer_and_read_remote_pulls_back(launch):
    a, b, c = launch("a"), launch("b"), launch("c")
    data = [np.full(BLOCK, i, np.uint8) for i in range(4)]
    kvs_a = PrefixStore(engine(a))
    h = kvs_a.save([1, 2, 3, 4], data, dst=b.address)           # stored on A, then pushed to B
    h.result(30)
    assert kvs_a.poll_save_status(h) is TransferStatus.DONE
    assert engine(a).lookup([1, 2, 3, 4]).prefix_len == 4
    assert engine(b).lookup([1, 2, 3, 4]).prefix_len == 4
    kvs_c = PrefixStore(engine(c))
    r = kvs_c.read_remote(b.address, [1, 2, 3, 4])
    assert r.result(30) == [True] * 4
    out = [np.zeros(BLOCK, np.uint8) for _ in range(4)]
    kvs_c.load([1, 2, 3, 4], out).result(30)
    assert [o[0] for o in out] == [0, 1, 2, 3] and all((o == o[0]).all() for o in out)
    # A peer that lacks a block: the handle fails and says how many arrived.
    bad = kvs_c.read_remote(a.address, [1, 99])
    with pytest.raises(tpusync.errors.UnavailableError, match="1 of 2"):
        bad.result(30)
    assert kvs_c.poll_remote_read_status(bad) is TransferStatus.FAILED
    for k in (kvs_a, kvs_c):
        k.close()


def test_registered_read_lands_in_device_pages(launch):
    prefill, decode = launch("p"), launch("d")
    k = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE)
    v = -k
    save_pages(engine(prefill), [21, 22, 23], [k, v], [0, 1, 2], page_axis=1)   # the prefill host's pages
    m = PageMover(engine(decode), jnp.zeros(SHAPE), jnp.zeros(SHAPE))
    m.register_read("req-1", prefill.address, [21, 22, 23], [5, 6, 7])
    m.register_read("req-2", prefill.address, [21, 99], [3, 4])   # 99 was never saved
    for handle in (m.start_read("req-1"), m.start_read("req-2")):
        handle.result(60)
    _, done, failed = m.poll_stats()
    assert done == {"req-1"} and failed == {"req-2"}
    for src, dst in ((0, 5), (1, 6), (2, 7)):
        assert np.array_equal(np.asarray(m.k[:, dst]), np.asarray(k[:, src]))
        assert np.array_equal(np.asarray(m.v[:, dst]), np.asarray(v[:, src]))
    m.close()
