"""The shared tier on real processes: several sidecars, each in a simulated host of the fabric
harness (harness/fabric.py), on one shared directory, and the same suite over a real
network filesystem: sshfs (FUSE) mounts of an sftp export in another host, over the fabric's
links (harness/sshfs.py)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import tpusync
from harness import fabric as fab
from harness.keys import keys_for
from harness.polling import wait_for
from tests.integration.conftest import engine
from tests.integration.shared.pool import (
    BLOCK,
    FILE_BYTES,
    LAYOUT,
    SECRET,
    data_for,
    metric,
    pulled_bytes,
    read_back,
    stored,
)


def test_a_block_written_on_one_host_is_served_on_another_without_a_transfer(make_pool):
    pool = make_pool(2)
    a, b = pool.start(0), pool.start(1)
    keys = keys_for(1, 8)
    data = data_for(keys)
    with engine(a) as ea, engine(b) as eb:
        ea.put(keys, data)
        ea.flush()  # write-through: on the shared tier now
        assert len(pool.files()) == 8
        looked = eb.lookup(keys)
        assert looked.prefix_len == 8 and list(looked.tiers) == [tpusync.Tier.SHARED] * 8
        got = read_back(eb, keys)
        assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data))
        st = eb.stats()
        assert st["hits_shared"] == 8 and st["shared"]["hits"] == 8 and st["shared"]["writes"] == 0
        # The tier probes O_DIRECT at open; ext4 and this kernel's FUSE (sshfs) both take it. The
        # buffered path is tests/unit/native's (native/tests/shared_tier_test.cc).
        assert st["shared"]["direct_io"] is True
    assert pulled_bytes(a) == 0 and pulled_bytes(b) == 0  # no block moved between the sidecars
    assert metric(b, "tpusync_shared_hits_total") == 8


def test_each_host_learns_what_another_stored_and_reads_its_records(make_pool):
    """What every host's engine needs to announce blocks it did not store: b's change feed names
    the blocks a stored within one of b's scans, `where` finds them on the tier, and the records
    a's engine wrote beside them read back through b's sidecar, and from the catalog. A block
    removed behind b's back is named again at b's next scan."""
    pool = make_pool(2)
    a, b = pool.start(0), pool.start(1, evict_ms=100)
    keys = keys_for(3, 4)
    ints = [int(hi) << 64 | int(lo) for hi, lo in keys]
    records = [b"parent and tokens of block %d" % i for i in range(4)]

    def named(eb, cursor, want: set[int]):
        seen: set[int] = set()
        while not want <= seen:  # each call a long poll on b's feed, bounded by the test's timeout
            batch = eb.changes(cursor, wait_s=5)
            assert batch.keys or not batch.lost, "b's feed named nothing in 5 s"
            cursor = batch.cursor
            seen |= set(batch.keys)
        return cursor

    with engine(a) as ea, engine(b) as eb:
        cursor = eb.changes().cursor
        ea.put(keys, data_for(keys))
        ea.flush()
        ea.describe(keys, records)
        cursor = named(eb, cursor, set(ints))
        assert metric(b, "tpusync_shared_blocks") == 4
        assert list(eb.where(keys)) == [tpusync.Tier.SHARED] * 4
        assert eb.records(keys) == dict(zip(ints, records))
        assert eb.records(max_keys=16) == dict(zip(ints, records))  # the catalog of b's last scan
        assert eb.lookup(keys[::-1][:2]).tiers.tolist() == [tpusync.Tier.SHARED] * 2
        gone = next(f for f in pool.files() if f.endswith(f"{ints[0]:032x}"))
        os.unlink(gone)
        named(eb, cursor, {ints[0]})
        assert list(eb.where(keys)) == [tpusync.Tier.NONE] + [tpusync.Tier.SHARED] * 3
        assert eb.stats()["shared"]["blocks"] == 3
        with pytest.raises(tpusync.errors.InvalidArgumentError):
            eb.describe(keys[:1], [b"x" * ((16 << 10) + 1)])


def test_two_hosts_writing_the_same_blocks_at_once(make_pool):
    pool = make_pool(2)
    cars = [pool.start(0), pool.start(1)]
    keys = keys_for(2, 24)
    data = data_for(keys)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def write(car) -> None:
        try:
            with engine(car) as e:
                barrier.wait()
                e.put(keys, data)
                e.flush()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(c,)) for c in cars]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(pool.files()) == 24 and not pool.temp_files()
    third = pool.start(0, dram_bytes=32 * BLOCK)  # a fresh pool on host 0: reads the tier only
    with engine(third) as e:
        got = read_back(e, keys)
    assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data))
    written = sum(metric(c, "tpusync_shared_written_total") for c in cars)
    assert 24 <= written <= 48  # each block published once or twice (the last rename wins)


def test_a_writer_killed_mid_write_leaves_whole_blocks_or_none(make_pool):
    pool = make_pool(2)
    a = pool.start(0, dram_bytes=64 * BLOCK)
    keys = keys_for(3, 64)
    data = data_for(keys)
    with engine(a) as ea:
        ea.put(keys, data)  # acknowledged in DRAM; the write-through is under way...
    a.kill()                # ...when the host dies
    b = pool.start(1)
    with engine(b) as eb:
        got = read_back(eb, keys)
        for g, d in zip(got, data):
            assert g is None or np.array_equal(g, d)  # a block is whole or a miss, never other bytes
        assert eb.stats()["shared"]["corruptions"] == 0  # rename publishes whole files only


def test_damaged_files_are_misses_counted_and_removed(make_pool):
    pool = make_pool(2)
    a, b = pool.start(0), pool.start(1)
    keys, data = stored(a, 4, 4)
    files = sorted(pool.files())
    with open(files[0], "r+b") as f:  # a bit flipped in the payload
        f.seek(4096 + 1000)
        byte = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    os.truncate(files[1], 4096 + 512)  # truncated
    with engine(b) as eb:
        got = read_back(eb, keys)
        by_file = {os.path.basename(p): p for p in files}
        for k, g, d in zip(keys, got, data):
            name = f"{int(k[0]):016x}{int(k[1]):016x}"
            if by_file.get(name) in files[:2]:
                assert g is None
            else:
                assert g is not None and np.array_equal(g, d)
        assert eb.stats()["shared"]["corruptions"] == 2
    assert metric(b, "tpusync_shared_corrupt_files_total") == 2
    assert not os.path.exists(files[0]) and not os.path.exists(files[1])


def test_a_full_filesystem_refuses_the_tier_and_loses_no_acknowledged_block(make_pool):
    pool = make_pool(2, size="2m")
    # Someone else's data fills the filesystem but for two block files: the tier cannot evict it.
    with open(os.path.join(pool.export, "other-data"), "wb") as f:
        f.write(b"x" * ((2 << 20) - 2 * FILE_BYTES - 64 * 1024))
    car = pool.start(1, dram_bytes=32 * BLOCK)  # through sshfs in that mode
    keys = keys_for(5, 16)
    data = data_for(keys)
    with engine(car) as e:
        e.put(keys, data)
        e.flush()
        st = e.stats()["shared"]
        # A local filesystem says ENOSPC; sftp reports a generic failure, an I/O error here.
        assert st["refused_full"] + st["write_errors"] > 0 and st["writes"] <= 2
        got = read_back(e, keys)  # every acknowledged block is still in DRAM
        assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data))
    assert car.stop() == 0
    assert not pool.temp_files()
    for path in pool.files():  # what was published is whole
        assert os.path.getsize(path) == FILE_BYTES


def test_evictors_on_every_host_spare_a_load_in_flight(make_pool):
    pool = make_pool(2)
    cap = 12 * FILE_BYTES
    a = pool.start(0, shared_bytes=cap, evict_ms=20, dram_bytes=64 * BLOCK)
    b = pool.start(1, shared_bytes=cap, evict_ms=20, dram_bytes=64 * BLOCK)
    first = keys_for(6, 6)
    first_data = data_for(first)
    with engine(a) as ea, engine(b) as eb:
        ea.put(first, first_data)
        ea.flush()
        held = eb.lookup(first, pin=True)  # host b starts loading the prefix: pinned on the tier
        assert held.prefix_len == 6
        more = keys_for(7, 24)
        for i in range(0, 24, 4):  # host a fills the tier far past its high watermark meanwhile
            ea.put(more[i:i + 4], data_for(more[i:i + 4]))
            ea.flush()
        evicted = metric(a, "tpusync_shared_evictions_total") + metric(b, "tpusync_shared_evictions_total")
        spared = sum(s.stats()["shared"][k] for s in (ea, eb) for k in ("pins_spared", "pins_restored"))
        got = read_back(eb, first)  # the load completes: nothing pinned was deleted
        assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, first_data))
        eb.release(first)
    assert evicted > 0 and spared > 0  # evictors passed the pinned blocks (the oldest) over, or put them back
    # Released, the spared blocks are evictable again: the evictors' next scans (every 20 ms)
    # take the tier back within its cap, which it may still exceed the moment the load ends.
    within = wait_for("the tier back within its cap", lambda: len(pool.files()) * FILE_BYTES <= cap, 10,
                      interval=0.02, raise_on_timeout=False)
    assert within, f"{len(pool.files())} files of {FILE_BYTES} bytes on the tier, over its cap of {cap}"


def test_the_tier_survives_a_restart_of_every_sidecar(make_pool):
    pool = make_pool(2)
    a, b = pool.start(0), pool.start(1)
    keys, data = stored(a, 8, 10)
    for car in (a, b):
        assert car.stop() == 0  # their DRAM pools go with them
    b2 = pool.start(1)
    with engine(b2) as eb:
        assert eb.stats()["shared"]["used_bytes"] == 10 * FILE_BYTES  # the index is the directory, rescanned
        got = read_back(eb, keys)
    assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data))


def test_engines_of_another_layout_never_read_the_blocks(make_pool):
    pool = make_pool(2)
    a = pool.start(0)
    b = pool.start(1, layout="model=test;dtype=bf16;tp=1;rank=1")
    keys = keys_for(9, 4)
    with engine(a) as ea, engine(b) as eb:
        ea.put(keys, data_for(keys))
        ea.flush()
        assert eb.lookup(keys).prefix_len == 0
        assert read_back(eb, keys) == [None] * 4


def test_blocks_reserved_for_root_do_not_make_the_filesystem_full(tmp_path):
    """The tier's filesystem watermark counts what df counts: on ext4 with half its blocks
    reserved (mkfs -m 50) and 70 % of the rest in use, the tier's blocks stay. Counting the
    reserved blocks as used (89 % here), every evictor on the pool deleted them: this machine's
    own disk shows 252 GB with 92 GB usable, which read as 85 % full."""
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    fab._run("mkfs.ext4", "-q", "-m", "50", str(image))
    fab._run("mount", "-o", "loop", str(image), str(mnt))
    try:
        with open(mnt / "someone-elses-data", "wb") as f:
            f.write(b"\0" * (14 << 20))
        keys = keys_for(7, 8)
        shared = {"dram_bytes": 16 * BLOCK, "block_bytes": BLOCK, "shared_dir": mnt, "shared_layout": LAYOUT,
                  "secret": SECRET}
        with tpusync.KVStore.local(**shared) as a:
            a.put(keys, data_for(keys))
            a.flush()
        st = os.statvfs(mnt)
        assert (st.f_blocks - st.f_bavail) / st.f_blocks > 0.85  # "full" by the old count
        with tpusync.KVStore.local(**shared) as b:  # its open runs an eviction pass
            assert b.stats()["shared"]["evictions"] == 0
            assert list(b.where(keys)) == [tpusync.Tier.SHARED] * 8
    finally:
        fab._run("umount", str(mnt))
