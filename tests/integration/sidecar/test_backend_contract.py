"""The three KVStore backends hold to one contract (tpusync.backend.BlockBackend): an
in-process store, the pod's sidecar over its control socket, and a sidecar's data port. Each
case runs against every backend that can serve it, with the same expected results; what the
data port cannot do (it maps no pool here) raises PreconditionError naming why. Real sidecar
processes on 127.0.0.1."""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import numpy as np
import pytest

import tpusync
from tests.integration.conftest import BLOCK, SECRET
from tpusync import Tier

POOLED = ["local", "sidecar"]  # the backends with a pool in this process's reach
ALL = [*POOLED, "data_port"]
NO_POOL = "data-port client \\(tpusync://\\) has no pool"


def data(key: int, size: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture
def sidecars(launch):
    return {"home": launch("home"), "peer": launch("peer")}


@pytest.fixture
def open_backend(sidecars) -> Iterator:
    opened: list[tpusync.KVStore] = []

    def _open(kind: str) -> tpusync.KVStore:
        home = sidecars["home"]
        if kind == "local":
            s = tpusync.KVStore.local(dram_bytes=64 * BLOCK, block_bytes=BLOCK, secret=SECRET)
        elif kind == "sidecar":
            s = tpusync.KVStore.connect(f"unix://{home.control_socket}")
        else:
            s = tpusync.KVStore.connect(f"tpusync://{home.address}", secret=SECRET)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


@pytest.mark.parametrize("kind", ALL)
def test_put_get_lookup_agree(open_backend, kind):
    s = open_backend(kind)
    blocks = {k: data(k, BLOCK if k % 2 else 1000) for k in range(100, 104)}
    s.put(list(blocks), list(blocks.values()))
    s.put(list(blocks), list(blocks.values()))  # present keys are skipped
    r = s.lookup([*blocks, 999])
    assert r.prefix_len == 4
    assert list(r.tiers) == [Tier.DRAM] * 4 + [Tier.NONE]
    out = [np.zeros(v.size, np.uint8) for v in blocks.values()] + [np.zeros(BLOCK, np.uint8)]
    assert s.get([*blocks, 999], out) == [True] * 4 + [False]
    for (k, want), got in zip(blocks.items(), out):
        assert np.array_equal(got, want), k
    # A block is found only in a buffer of its length: a short one in a full-size buffer is a
    # miss on every backend, and the buffer is left as it was (no stale tail read as the block).
    full = [np.full(BLOCK, 7, np.uint8) for _ in blocks]
    assert s.get(list(blocks), full) == [k % 2 == 1 for k in blocks]
    assert all((f == 7).all() for k, f in zip(blocks, full) if k % 2 == 0)
    assert s.block_bytes == BLOCK
    assert s.stats()["block_bytes"] == BLOCK
    s.flush()


@pytest.mark.parametrize("kind", ALL)
def test_malformed_puts_raise_the_same_errors(open_backend, kind):
    s = open_backend(kind)
    with pytest.raises(tpusync.InvalidArgumentError):
        s.put([1], [np.zeros(BLOCK + 1, np.uint8)])
    with pytest.raises(tpusync.InvalidArgumentError):
        s.put([1], [np.zeros(0, np.uint8)])
    assert s.lookup([1]).prefix_len == 0


@pytest.mark.parametrize("kind", POOLED)
def test_pins_evict_and_stats(open_backend, kind):
    s = open_backend(kind)
    s.put([1, 2], [data(1), data(2)])
    with pytest.raises(tpusync.NotFoundError):
        s.pin([50])
    with pytest.raises(tpusync.PreconditionError, match="not pinned"):
        s.release([1])
    assert s.lookup([1, 2], pin=True).prefix_len == 2
    assert s.stats()["pinned"] == 2
    s.release([1, 2])
    assert s.stats()["pinned"] == 0
    s.evict([1])
    assert s.lookup([1, 2]).prefix_len == 0 and s.lookup([2]).prefix_len == 1


@pytest.mark.parametrize("kind", POOLED)
def test_slots_written_and_read_in_place(open_backend, kind):
    s = open_backend(kind)
    s.put([1], [data(1)])
    with s.reserve_many([1, 2, 3]) as slots:
        assert slots[0] is None  # stored already
        assert slots[1] is not None and slots[2] is not None
        np.frombuffer(slots[1].view, np.uint8, count=BLOCK)[:] = data(2)
        slots[1].commit(BLOCK)  # slot 3 is left uncommitted: given back
    assert list(s.lookup([1, 2, 3]).tiers) == [Tier.DRAM, Tier.DRAM, Tier.NONE]
    with s.acquire_many([2, 3]) as views:
        assert views[1] is None
        assert views[0] is not None and views[0].readonly
        assert np.array_equal(np.frombuffer(views[0], np.uint8), data(2))
    # One slot as a lease object: the same on both; the bytes sit in the pool file.
    lease = s.reserve(4)
    np.frombuffer(lease, np.uint8)[:] = data(4)
    lease.commit(BLOCK)
    del lease
    read = s.acquire(4)
    with open(s.pool_path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert m[read.file_offset:read.file_offset + BLOCK] == data(4).tobytes()
    with pytest.raises(tpusync.PreconditionError, match="1 leases"):
        s.close()
    del read
    with pytest.raises(tpusync.NotFoundError, match="not stored"):
        s.acquire(12345)


@pytest.mark.parametrize("kind", POOLED)
def test_transfers_with_a_peer(open_backend, sidecars, kind):
    s = open_backend(kind)
    peer = tpusync.KVStore.connect(f"unix://{sidecars['peer'].control_socket}")
    try:
        peer.put([1, 2, 3], [data(1), data(2), data(3)])
        s.put([1], [data(1)])
        held, landed, digests = s.read_remote_digests(f"tpusync://{sidecars['peer'].address}", [1, 2, 3, 4])
        assert held == [True, True, True, False]
        assert landed == [False, True, True, False]  # block 1 was held already: it did not travel
        assert digests[0] == 0 and digests[1] != 0 and digests[2] != 0
        s.put([10], [data(10)])
        assert s.push_remote(sidecars["peer"].address, [10]) == [True]
        assert s.exists_remote(sidecars["peer"].address, [10, 11]) == [True, False]
        out = [np.zeros(BLOCK, np.uint8)]
        assert peer.get([10], out) == [True] and np.array_equal(out[0], data(10))
    finally:
        peer.close()


def test_the_data_port_refuses_what_needs_a_pool_with_the_reason(open_backend, sidecars):
    s = open_backend("data_port")
    s.put([1], [data(1)])
    peer = sidecars["peer"].address
    refused = [
        lambda: s.lookup([1], pin=True), lambda: s.pin([1]), lambda: s.release([1]), lambda: s.evict([1]),
        lambda: s.reserve(2), lambda: s.acquire(1), lambda: s.read_remote(peer, [1]),
        lambda: s.push_remote(peer, [1]), lambda: s.exists_remote(peer, [1]),
    ]
    for call in refused:
        with pytest.raises(tpusync.PreconditionError, match=NO_POOL):
            call()
    with pytest.raises(tpusync.PreconditionError, match=NO_POOL), s.reserve_many([3]):
        pass
    with pytest.raises(tpusync.PreconditionError, match=NO_POOL), s.acquire_many([1]):
        pass
    assert s.pool_path == ""
    assert s.lookup([1]).prefix_len == 1  # nothing above changed the store


def test_a_local_store_without_the_secret_says_so(open_backend, sidecars):
    with tpusync.KVStore.local(dram_bytes=4 * BLOCK, block_bytes=BLOCK) as s:
        with pytest.raises(tpusync.PreconditionError, match="secret"):
            s.read_remote(sidecars["peer"].address, [1])
        with pytest.raises(tpusync.PreconditionError, match="secret"):
            s.push_remote(sidecars["peer"].address, [1])
