"""KVStore.local over the native engine: data path, tiers, pins, errors, zero-copy, GIL."""

from __future__ import annotations

import mmap
import os
import socket
import sys
import threading
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import tpusync
from tpusync import Tier

KIB, MIB = 1 << 10, 1 << 20
BLOCK = 64 * KIB


def pattern(seed: int, nbytes: int = BLOCK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture
def store():
    with tpusync.KVStore.local(dram_bytes=16 * BLOCK, block_bytes=BLOCK) as s:
        yield s


@pytest.fixture
def tiered(tmp_path):
    with tpusync.KVStore.local(dram_bytes=4 * BLOCK, block_bytes=BLOCK, disk_dir=tmp_path / "disk",
                               disk_bytes=64 * BLOCK) as s:
        yield s


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.int64, np.float16, ml_dtypes.bfloat16])
def test_put_get_round_trip_every_dtype(store, dtype):
    src = pattern(1).view(dtype)
    out = np.zeros_like(src)
    store.put([7], [src])
    assert store.get([7], [out]) == [True]
    assert out.tobytes() == src.tobytes()


@pytest.mark.parametrize("key", [0, 2**63 - 1, 2**64 + 5, 2**128 - 1, b"\x01" * 16])
def test_keys_as_ints_and_bytes(store, key):
    store.put([key], [pattern(2)])
    assert store.lookup([key]).prefix_len == 1


def test_int_bytes_and_array_keys_address_the_same_block(store):
    k = (0x0102030405060708 << 64) | 0x090A0B0C0D0E0F10
    store.put([k], [pattern(3)])
    as_bytes = k.to_bytes(16, "big")
    as_array = np.array([[0x0102030405060708, 0x090A0B0C0D0E0F10]], dtype=np.uint64)
    assert store.lookup([as_bytes]).prefix_len == 1
    assert store.lookup(as_array).prefix_len == 1


def test_lookup_reports_prefix_and_tiers(store):
    store.put([1, 2, 3], [pattern(i) for i in range(3)])
    r = store.lookup([1, 2, 99, 3])
    assert r.prefix_len == 2
    assert list(r.tiers) == [Tier.DRAM, Tier.DRAM, Tier.NONE, Tier.DRAM]


def test_lookup_pin_protects_the_prefix_from_eviction(store):
    store.put(list(range(16)), [pattern(i) for i in range(16)])
    assert store.lookup([0, 1], pin=True).prefix_len == 2
    store.put(list(range(100, 116)), [pattern(i) for i in range(16)])  # churns all unpinned slots
    assert list(store.lookup([0, 1, 2]).tiers) == [Tier.DRAM, Tier.DRAM, Tier.NONE]
    assert store.stats()["pinned"] == 2
    store.release([0, 1])
    assert store.stats()["pinned"] == 0


def test_dram_full_of_pinned_blocks_is_a_capacity_error(store):
    store.put(list(range(16)), [pattern(i) for i in range(16)])
    store.pin(list(range(16)))
    with pytest.raises(tpusync.CapacityError, match="pinned"):
        store.put([500], [pattern(5)])
    store.release([3])
    store.put([500], [pattern(5)])
    assert store.lookup([3]).prefix_len == 0


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda s: s.put([-1], [pattern(0)]), tpusync.InvalidArgumentError, "non-negative"),
        (lambda s: s.put([2**128], [pattern(0)]), tpusync.InvalidArgumentError, "below 2\\*\\*128"),
        (lambda s: s.put([b"short"], [pattern(0)]), tpusync.InvalidArgumentError, "16 bytes"),
        (lambda s: s.put([1.5], [pattern(0)]), TypeError, "block key"),
        (lambda s: s.put([1, 2], [pattern(0)]), tpusync.InvalidArgumentError, "2 keys but 1 buffers"),
        (lambda s: s.put([1], [pattern(0, BLOCK + 1)]), tpusync.InvalidArgumentError, "buffer 0 holds 65537"),
        (lambda s: s.put([1], [np.zeros(0, np.uint8)]), tpusync.InvalidArgumentError, "holds 0 bytes"),
        (lambda s: s.put([1], [np.zeros((64, 2048), np.uint8)[:, ::2]]), TypeError, "C-contiguous"),
        (lambda s: s.put([1], [object()]), TypeError, "buffer 0"),
        (lambda s: s.put(np.zeros((2, 3), np.uint64), [pattern(0)] * 2), TypeError, "shape \\(n, 2\\)"),
        (lambda s: s.pin([12345]), tpusync.NotFoundError, "not stored"),
        (lambda s: s.release([12345]), tpusync.PreconditionError, "not pinned"),
        (lambda s: s.acquire(12345), tpusync.NotFoundError, "not stored"),
    ],
)
def test_bad_calls_raise_typed_errors_and_change_nothing(store, call, error, message):
    before = store.stats()
    with pytest.raises(error, match=message):
        call(store)
    after = store.stats()
    assert (after["blocks"], after["dram_used"], after["pinned"]) == (before["blocks"], before["dram_used"], 0)


def test_get_checks_output_buffers(store):
    store.put([1], [pattern(1)])
    with pytest.raises(TypeError, match="writable"):
        store.get([1], [bytes(BLOCK)])
    with pytest.raises(tpusync.InvalidArgumentError, match="output buffer 0 holds 10 bytes"):
        store.get([1], [np.zeros(10, np.uint8)])


def test_get_of_missing_and_short_blocks(store):
    store.put([1], [pattern(1, 1000)])
    out = [np.zeros(1000, np.uint8), np.zeros(BLOCK, np.uint8)]
    assert store.get([1, 2], out) == [True, False]
    assert out[0].tobytes() == pattern(1, 1000).tobytes()
    assert store.stats()["misses"] == 1
    # Into a whole block's buffer the short block is a miss: found never leaves a buffer half stale.
    whole = np.full(BLOCK, 7, np.uint8)
    assert store.get([1], [whole]) == [False]
    assert (whole == 7).all()
    assert store.stats()["misses"] == 2


def test_errors_are_also_builtin_exception_types(store):
    with pytest.raises(ValueError):
        store.put([-1], [pattern(0)])
    with pytest.raises(KeyError):
        store.pin([42])


def test_local_rejects_a_geometry_that_holds_no_block():
    with pytest.raises(tpusync.InvalidArgumentError, match="at least one block"):
        tpusync.KVStore.local(dram_bytes=100, block_bytes=BLOCK)
    with pytest.raises(tpusync.InvalidArgumentError, match="multiple of 4096"):
        tpusync.KVStore.local(dram_bytes=BLOCK * 4, block_bytes=5000)


def test_closed_store_raises(store):
    store.close()
    with pytest.raises(tpusync.PreconditionError, match="closed"):
        store.lookup([1])


# ---- zero-copy -------------------------------------------------------------------------


def test_leases_expose_the_pool_slot_itself(store, shm_path):
    lease = store.reserve(11)
    view = np.frombuffer(lease, dtype=np.uint8)
    view[:] = pattern(11)  # written in place, straight into shared memory
    slot_address = view.ctypes.data
    lease.commit(BLOCK)
    del view, lease
    read = store.acquire(11)
    rview = np.frombuffer(read, dtype=np.uint8)
    assert rview.ctypes.data == slot_address  # the same bytes, not a copy
    assert not rview.flags.writeable
    assert rview.tobytes() == pattern(11).tobytes()
    # Another mapping of the pool file sees the block at the lease's file offset.
    with open(store.pool_path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert m[read.file_offset:read.file_offset + BLOCK] == pattern(11).tobytes()


def test_close_refuses_while_leases_are_held(store):
    store.put([1], [pattern(1)])
    lease = store.acquire(1)
    with pytest.raises(tpusync.PreconditionError, match="1 leases"):
        store.close()
    del lease
    store.close()


def test_leases_taken_at_once_are_each_released_on_their_own(store):
    store.put([1, 2], [pattern(1), pattern(2)])
    one, absent, two = store.acquire_each([1, 3, 2])
    assert absent is None
    assert np.frombuffer(one, np.uint8).tobytes() == pattern(1).tobytes()
    assert np.frombuffer(two, np.uint8).tobytes() == pattern(2).tobytes()
    with pytest.raises(tpusync.PreconditionError, match="2 leases"):
        store.close()
    del one
    with pytest.raises(tpusync.PreconditionError, match="1 leases"):
        store.close()
    store.evict([1])  # its lease is gone: the block can leave DRAM
    assert store.lookup([1]).prefix_len == 0
    del two
    store.close()


def test_uncommitted_write_lease_frees_its_slot(store):
    lease = store.reserve(5)
    assert store.stats()["dram_used"] == 1
    assert store.lookup([5]).prefix_len == 0
    del lease
    assert store.stats()["dram_used"] == 0
    store.put([5], [pattern(5)])  # the key is free again


def test_put_and_get_make_no_python_side_copies():
    src = [pattern(i, 4 * MIB) for i in range(16)]
    out = [np.zeros(4 * MIB, np.uint8) for _ in range(16)]
    with tpusync.KVStore.local(dram_bytes=64 * MIB, block_bytes=4 * MIB) as s:
        tracemalloc.start()
        s.put(list(range(16)), src)
        s.get(list(range(16)), out)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 1 * MIB, f"{peak} bytes allocated by Python for 64 MiB moved"
    assert all(np.array_equal(a, b) for a, b in zip(src, out))


def test_jax_cpu_arrays_go_in_without_a_copy():
    import jax
    import jax.numpy as jnp

    x = jnp.arange(BLOCK // 2, dtype=jnp.bfloat16)
    host = np.asarray(x)  # a view of the CPU buffer
    assert host.ctypes.data == x.unsafe_buffer_pointer()
    out = np.zeros(BLOCK // 2, dtype=ml_dtypes.bfloat16)
    with tpusync.KVStore.local(dram_bytes=4 * BLOCK, block_bytes=BLOCK) as s:
        s.put([1], [host])
        assert s.get([1], [out]) == [True]
    assert jnp.array_equal(jnp.asarray(out), x)
    assert jax.devices()[0].platform == "cpu"


# ---- GIL -------------------------------------------------------------------------------


def test_gil_is_released_during_long_copies():
    """A Python thread keeps running while a 512 MiB get copies in native code.

    Were the GIL held, the spinner could only run in the few microseconds of Python code at
    either end of the call, never in its middle half.
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    block, n = 16 * MIB, 32
    src = [np.full(block, i, np.uint8) for i in range(n)]
    out = [np.zeros(block, np.uint8) for _ in range(n)]
    stamps: list[float] = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    try:
        with tpusync.KVStore.local(dram_bytes=n * block, block_bytes=block) as s:
            s.put(list(range(n)), src)
            spinner = threading.Thread(target=spin)
            spinner.start()
            t0 = time.perf_counter()
            s.get(list(range(n)), out)
            t1 = time.perf_counter()
            stop.set()
            spinner.join()
    finally:
        sys.setswitchinterval(old)
    quarter = (t1 - t0) / 4
    assert t1 - t0 > 0.004, "the copy was too short to tell"
    in_middle = [t for t in stamps if t0 + quarter < t < t1 - quarter]
    assert in_middle, "no Python thread ran while the native get was copying"
    assert out[-1][0] == n - 1


def test_close_during_a_running_get_waits_for_it():
    """close() from another thread while a long get copies with the GIL released: the get
    finishes with whole blocks, later calls say the store is closed, nothing crashes."""
    block, n = 16 * MIB, 32
    s = tpusync.KVStore.local(dram_bytes=n * block, block_bytes=block)
    s.put(list(range(n)), [np.full(block, i, np.uint8) for i in range(n)])
    out = [np.zeros(block, np.uint8) for _ in range(n)]
    started, result = threading.Event(), []

    def reader():
        started.set()
        try:
            result.append(s.get(list(range(n)), out))
        except tpusync.PreconditionError:   # close() came first
            result.append(None)

    t = threading.Thread(target=reader)
    t.start()
    started.wait()
    s.close()          # may land before, during or after the copy
    t.join()
    if result[0] is not None:   # the get started before close: it completed whole
        assert all(result[0]) and all(o[0] == i and o[-1] == i for i, o in enumerate(out))
    with pytest.raises(tpusync.PreconditionError, match="closed"):
        s.get([0], out[:1])


# ---- disk tier -------------------------------------------------------------------------


def test_overflow_goes_to_disk_and_comes_back_byte_exact(tiered):
    data = {k: pattern(k) for k in range(32)}
    tiered.put(list(data), list(data.values()))
    tiered.flush()
    tiers = tiered.lookup(list(data)).tiers
    assert (tiers == Tier.DISK).sum() >= 28
    out = [np.zeros(BLOCK, np.uint8) for _ in data]
    assert all(tiered.get(list(data), out))
    assert all(np.array_equal(o, data[k]) for k, o in zip(data, out))
    st = tiered.stats()
    assert st["promotions"] >= 28 and st["direct_io"] in (True, False)


def test_corrupted_disk_block_is_a_miss_and_reported(tmp_path):
    disk = tmp_path / "disk"
    with tpusync.KVStore.local(dram_bytes=4 * BLOCK, block_bytes=BLOCK, disk_dir=disk,
                               disk_bytes=8 * BLOCK) as s:
        s.put([1], [pattern(1)])
        s.evict([1])
        assert s.lookup([1]).tiers[0] == Tier.DISK
        with open(disk / "extents.dat", "r+b") as f:  # one bit flipped in the payload
            f.seek(4096 + 1000)
            b = f.read(1)[0]
            f.seek(4096 + 1000)
            f.write(bytes([b ^ 0x10]))
        out = np.zeros(BLOCK, np.uint8)
        assert s.get([1], [out]) == [False]
        assert not out.any()  # no wrong bytes were handed out
        st = s.stats()
        assert st["corruptions"] == 1
        assert "checksum mismatch" in st["last_error"]
        assert s.lookup([1]).prefix_len == 0


def test_full_disk_is_an_error_not_a_crash(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    os.symlink("/dev/full", disk / "extents.dat")  # every write fails with ENOSPC
    with tpusync.KVStore.local(dram_bytes=4 * BLOCK, block_bytes=BLOCK, disk_dir=disk,
                               disk_bytes=16 * BLOCK) as s:
        s.put(list(range(12)), [pattern(i) for i in range(12)])
        with pytest.raises(tpusync.CapacityError, match="No space left"):
            s.flush()
        assert s.stats()["disk_write_errors"] > 0
        out = np.zeros(BLOCK, np.uint8)
        assert s.get([11], [out]) == [True]
        assert np.array_equal(out, pattern(11))
        with pytest.raises(tpusync.CapacityError):
            s.evict([11])
        s.flush()  # reported once


def test_disk_capacity_beyond_the_filesystem_is_refused(tmp_path):
    st = os.statvfs(tmp_path)
    too_much = st.f_bavail * st.f_frsize + (1 << 30)
    with pytest.raises(tpusync.CapacityError, match="needs"):
        tpusync.KVStore.local(dram_bytes=4 * MIB, block_bytes=MIB, disk_dir=tmp_path / "d", disk_bytes=too_much)


def test_a_control_socket_that_answers_garbage_raises_protocol_error(tmp_path):
    """A reply that breaks the protocol is typed (status code 11, MALFORMED), not told by its
    text: Python raises ProtocolError, an UnavailableError (the channel is dropped)."""
    path = str(tmp_path / "not-a-sidecar.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)

    def answer_garbage():
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"\x5a" * 32)  # a frame header's size, no frame's magic
        conn.close()

    t = threading.Thread(target=answer_garbage)
    t.start()
    try:
        with pytest.raises(tpusync.errors.ProtocolError, match="bad frame: wrong magic") as raised:
            tpusync.KVStore.connect(f"unix://{path}", timeout=5)
        assert isinstance(raised.value, tpusync.errors.UnavailableError)
    finally:
        t.join()
        server.close()


def test_the_pool_region_holds_every_slot_and_goes_with_the_store():
    s = tpusync.KVStore.local(dram_bytes=16 * BLOCK, block_bytes=BLOCK)
    address, size = s.pool_region()
    assert size >= 16 * BLOCK and size == os.path.getsize(s.pool_path)
    s.put([1], [pattern(1)])
    with s.acquire_many([1]) as views:
        slot = np.frombuffer(views[0], np.uint8).ctypes.data
        assert address <= slot and slot + BLOCK <= address + size
    s.close()
    assert s.pool_region() is None  # unmapped with the store: nothing left to register
