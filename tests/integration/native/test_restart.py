"""Real processes: a writer killed with SIGKILL, a reader that re-opens its pool and disk tier."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tpusync
from tpusync import Tier

BLOCK = 64 << 10

WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import tpusync

    pool, disk, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    s = tpusync.KVStore.local(dram_bytes=8 * {block}, block_bytes={block}, pool_path=pool,
                              disk_dir=disk, disk_bytes=64 * {block})
    data = [np.random.default_rng(k).integers(0, 256, {block}, dtype=np.uint8) for k in range(n)]
    s.put(list(range(n)), data)
    s.flush()
    print("ready", s.stats()["demotions"], flush=True)
    sys.stdin.read()  # hold the store open until killed
    """
).format(block=BLOCK)


def expected(k: int) -> np.ndarray:
    return np.random.default_rng(k).integers(0, 256, BLOCK, dtype=np.uint8)


def start_writer(pool: str, disk: str, n: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", WRITER, pool, disk, str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("ready"), f"writer failed: {line!r}"
    return p


def test_blocks_survive_the_writer_being_killed(shm_path, tmp_path):
    writer = start_writer(shm_path, str(tmp_path / "disk"), 40)
    writer.send_signal(signal.SIGKILL)
    writer.wait()

    with tpusync.KVStore.local(dram_bytes=8 * BLOCK, block_bytes=BLOCK, pool_path=shm_path,
                               disk_dir=tmp_path / "disk", disk_bytes=64 * BLOCK) as s:
        st = s.stats()
        assert st["recovered_dram"] > 0 and st["recovered_disk"] > 0
        tiers = s.lookup(list(range(40))).tiers
        assert (tiers != Tier.NONE).all()
        assert (tiers == Tier.DISK).any() and (tiers != Tier.DISK).any()
        out = [np.zeros(BLOCK, np.uint8) for _ in range(40)]
        assert all(s.get(list(range(40)), out))
        for k, o in enumerate(out):
            assert np.array_equal(o, expected(k)), k


def test_a_live_pool_has_one_owner(shm_path, tmp_path):
    writer = start_writer(shm_path, str(tmp_path / "disk"), 2)
    try:
        with pytest.raises(tpusync.PreconditionError, match="owned by another process"):
            tpusync.KVStore.local(dram_bytes=8 * BLOCK, block_bytes=BLOCK, pool_path=shm_path)
        with pytest.raises(tpusync.PreconditionError, match="owned by another process"):
            tpusync.KVStore.local(dram_bytes=8 * BLOCK, block_bytes=BLOCK, disk_dir=tmp_path / "disk",
                                  disk_bytes=64 * BLOCK)
    finally:
        writer.kill()
        writer.wait()


def test_reopening_with_another_geometry_is_refused(shm_path):
    with tpusync.KVStore.local(dram_bytes=8 * BLOCK, block_bytes=BLOCK, pool_path=shm_path):
        pass
    with pytest.raises(tpusync.PreconditionError, match="holds 8 slots of 65536 bytes"):
        tpusync.KVStore.local(dram_bytes=16 * BLOCK, block_bytes=BLOCK, pool_path=shm_path)
