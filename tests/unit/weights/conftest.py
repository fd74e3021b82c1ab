"""The weights unit tests' store: in-process, on a fresh pool."""

from __future__ import annotations

import gc
import shutil

import pytest

import tpusync


@pytest.fixture
def local_store(shm_path):
    """local_store(dram_bytes, block_bytes) opens the store; afterwards it is closed, once the leaves
    read zero-copy are collected (they hold read leases), and its weights directory removed."""
    opened = []

    def _open(dram_bytes: int, block_bytes: int) -> tpusync.KVStore:
        opened.append(tpusync.KVStore.local(dram_bytes=dram_bytes, block_bytes=block_bytes, pool_path=shm_path))
        return opened[-1]

    yield _open
    gc.collect()
    for s in opened:
        s.close()
    shutil.rmtree(shm_path + ".weights", ignore_errors=True)
