"""The shared tier's trust model on real sidecars and a real shared directory (local and sshfs):
anyone who can write to the directory, without the pool's secret, can plant files there, and
none of it reaches an engine or a sampler, and a second pool mounted on the same directory
never reads this pool's blocks (native/src/store/include/store/shared_tier.h, docs/native.md)."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import xxhash

import tpusync
from harness.keys import keys_for
from harness.polling import wait_for
from tests.integration.conftest import engine
from tests.integration.shared.pool import BLOCK, data_for, read_back, stored
from tpusync.weights import VersionedWeights


def _block_files(export: str) -> list[Path]:
    """Every file of a block that the directory shows: <layout dir>/<kk>/<32 hex digits>."""
    return [p for p in Path(export).rglob("*") if p.is_file() and len(p.name) == 32 and len(p.parent.name) == 2
            and p.name.startswith(p.parent.name) and p.parent.parent.joinpath("layout").is_file()]


def plant(export: str, key: int, payload: bytes) -> list[Path]:
    """What a writer without the secret can do from the directory alone: next to every block
    file it finds, a file for `key` built from that file: the header copied with the key
    patched in, the checksums of the format it knows (XXH3 over the payload and over the
    header, as tpusync-shared-v1 wrote them) recomputed, and its own payload. Returns the
    planted files."""
    planted = []
    for model in _block_files(export):
        raw = model.read_bytes()
        header = bytearray(raw[:4096])
        hi, lo = key >> 64, key & ((1 << 64) - 1)
        struct.pack_into("<QQQ", header, 32, hi, lo, len(payload))
        struct.pack_into("<Q", header, 56, xxhash.xxh3_64_intdigest(payload))
        struct.pack_into("<Q", header, 64, xxhash.xxh3_64_intdigest(bytes(header[:64])))
        name = f"{key:032x}"
        target = model.parent.parent / name[:2] / name
        target.parent.mkdir(exist_ok=True)
        padded = payload + b"\0" * (-len(payload) % 4096)
        target.write_bytes(bytes(header) + padded)
        planted.append(target)
    return planted


def as_int(row) -> int:
    return int(row[0]) << 64 | int(row[1])


def test_a_block_planted_in_the_directory_never_reaches_an_engine(make_pool):
    """A planted block is a miss on every host (lookup, where, get), is never announced (the
    catalog every host's KV events come from), and the real block written later under its key
    is served whole."""
    pool = make_pool(2)
    a, b = pool.start(0), pool.start(1, evict_ms=100)
    stored(a, 1, 2)  # real blocks, so the directory shows the format
    target = keys_for(2, 1)
    assert plant(pool.export, as_int(target[0]), np.full(BLOCK, 0x5A, np.uint8).tobytes())
    after, _ = stored(a, 5, 1)  # a block published after the plant: b's catalog has it once a scan saw both
    with engine(b) as eb:
        wait_for("b's scan to find a block published after the plant", lambda: as_int(after[0]) in eb.records(), 30)
        assert as_int(target[0]) not in eb.records()
        assert eb.lookup(target).prefix_len == 0
        assert list(eb.where(target)) == [tpusync.Tier.NONE]
        assert read_back(eb, target) == [None]
    real = data_for(target)
    with engine(a) as ea:
        ea.put(target, real)
        ea.flush()
    with engine(b) as eb:
        got = read_back(eb, target)
        assert got[0] is not None and np.array_equal(got[0], real[0])


def test_a_second_pool_on_the_same_directory_reads_none_of_this_pools_blocks(make_pool):
    pool = make_pool(2)
    a = pool.start(0)
    other = pool.start(1, secret=b"another pool's secret, 32 bytes!")
    keys, _ = stored(a, 3, 4)
    with engine(other) as eo:
        assert eo.lookup(keys).prefix_len == 0
        assert read_back(eo, keys) == [None] * 4
        assert eo.stats()["shared"]["corruptions"] == 0  # it never even opened them
    # Its own blocks live beside, under another pool directory.
    keys_o, data_o = stored(other, 4, 2)
    with engine(other) as eo:
        got = read_back(eo, keys_o)
        assert all(g is not None and np.array_equal(g, d) for g, d in zip(got, data_o))
    pools = {p.relative_to(pool.export).parts[1] for p in _block_files(pool.export)}
    assert len(pools) == 2


def _params(value: float) -> dict[str, jnp.ndarray]:
    return {"w": jnp.full((3, 70_000), value, jnp.float32), "b": jnp.full((5,), value, jnp.float32)}


def test_a_weight_version_cannot_be_forged_nor_preempted_through_the_shared_directory(make_pool, tmp_path):
    """The attack: with write access to the shared directory only, publish version 1 of the
    model first (every key of a version is computable), so the sampler loads it and the
    trainer's own publish(1) fails as already committed. A local store without the secret is
    refused; one with its own secret writes where this pool never looks; its files copied into
    this pool's directory never verify. The trainer publishes, the sampler loads the real one."""
    pool = make_pool(2)
    trainer_host, sampler_host = pool.start(0, dram_bytes=64 * BLOCK), pool.start(1, dram_bytes=64 * BLOCK)
    shared = pool.export  # the attacker writes on the file server's side
    before = set(Path(shared).glob("tpusync-shared-v2/*/*"))  # the pool's layout directory, made by its sidecars
    with pytest.raises(tpusync.errors.InvalidArgumentError, match="secret"):
        tpusync.KVStore.local(dram_bytes=64 * BLOCK, block_bytes=BLOCK, shared_dir=shared,
                              shared_layout="model=test;dtype=bf16;tp=1;rank=0")
    with tpusync.KVStore.local(dram_bytes=64 * BLOCK, block_bytes=BLOCK, shared_dir=shared,
                               shared_layout="model=test;dtype=bf16;tp=1;rank=0",
                               secret=b"the attacker's own secret, 32 b!") as forger:
        VersionedWeights(forger, "m").publish(_params(666.0), 1)
        forger.flush()
    # The forger's files (its pool directory is the one the sidecars did not make), copied into
    # this pool's layout directory.
    (ours,) = before
    for theirs in set(Path(shared).glob("tpusync-shared-v2/*/*")) - before:
        for f in theirs.rglob("*"):
            rel = f.relative_to(theirs)
            if f.is_file() and rel.parts[0] not in ("tmp", "pins", "layout"):
                (ours / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, ours / rel)

    trainer = VersionedWeights(engine(trainer_host), "m")
    trainer.publish(_params(1.0), 1)  # never "already committed"
    trainer.store.flush()
    sampler = VersionedWeights(engine(sampler_host), "m")
    sampler.bind_weights(_params(0.0))
    sampler.load(1)
    assert sampler.version == 1
    got = sampler.params
    assert np.all(np.asarray(got["w"]) == 1.0) and np.all(np.asarray(got["b"]) == 1.0)
