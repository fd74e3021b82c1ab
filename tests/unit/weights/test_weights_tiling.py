"""A version's shards must tile each leaf exactly (inside it, disjoint, covering), and each
shard's blocks hold exactly its bytes: otherwise the version is refused wherever its manifest
is read, and a sampler stays on the version it has (a sampler fills a leaf shard by shard
into an uninitialised buffer: a manifest that is no tiling would serve that memory)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from tpusync import errors
from tpusync.weights import VersionedWeights
from tpusync.weights.checksums import checksum
from tpusync.weights.codec import encode_commit, manifest_blocks
from tpusync.weights.inplace import await_version, pinned_version
from tpusync.weights.keys import commit_key, ref_key, weight_key
from tpusync.weights.manifest import (
    BlockRef,
    LeafEntry,
    Manifest,
    ShardEntry,
    check_manifest,
    merge_parts,
    tiling_problem,
)
from tpusync.weights.storage import read_manifest, write_manifest
from tpusync.weights.tensors import Shard

TOP, BOTTOM = ((0, 2), (0, 2)), ((2, 4), (0, 2))


@pytest.mark.parametrize("shape, indexes, whole, problem", [
    ((4, 2), [((0, 4), (0, 2))], True, None),
    ((4, 2), [TOP, BOTTOM], True, None),
    ((4, 4), [((0, 2), (0, 2)), ((0, 2), (2, 4)), ((2, 4), (0, 2)), ((2, 4), (2, 4))], True, None),
    ((), [()], True, None),
    ((4, 2), [TOP], False, None),                          # a part: need not cover
    ((4, 2), [TOP, TOP], True, r"shards \[0:2, 0:2\] and \[0:2, 0:2\] overlap"),
    ((4, 2), [TOP, ((1, 4), (0, 2))], True, r"shards \[0:2, 0:2\] and \[1:4, 0:2\] overlap"),
    ((4, 2), [TOP, ((1, 3), (1, 2))], False, "overlap"),   # a part's shards must be disjoint too
    ((), [(), ()], True, r"shards \[\] and \[\] overlap"),
    ((4, 2), [TOP, ((2, 5), (0, 2))], True, r"shard \[2:5, 0:2\] is empty or outside the leaf's shape \(4, 2\)"),
    ((4, 2), [((-1, 2), (0, 2)), BOTTOM], True, "outside"),
    ((4, 2), [((0, 4),)], True, "outside"),                # one dimension short
    ((4, 2), [((0, 0), (0, 2)), ((0, 4), (0, 2))], True, "empty"),
    ((4, 2), [TOP], True, "the shards cover 4 of its 8 elements"),
])
def test_tiling_problem(shape, indexes, whole, problem):
    got = tiling_problem(shape, indexes, whole=whole)
    if problem is None:
        assert got is None
    else:
        assert got is not None
        assert re.search(problem, got), got


def test_many_shards_are_checked_in_row_batches():
    """More shards than one batch of rows: an overlap between the last shard and the first
    is found across batches, and a true tiling of 600 rows passes."""
    rows = [((i, i + 1), (0, 3)) for i in range(600)]
    assert tiling_problem((600, 3), rows) is None
    assert "overlap" in tiling_problem((600, 3), rows[:-1] + [((0, 1), (0, 3))], whole=False)


def leaf(name="w", shape=(4, 2), shards=((TOP, 16), (BOTTOM, 16)), dtype="float32"):
    return LeafEntry(name, shape, dtype, "sharded", tuple(
        ShardEntry(index, (BlockRef(1000 + i, n, i),)) for i, (index, n) in enumerate(shards)))


def manifest(*leaves, block_bytes=1024):
    return Manifest("m", 1, block_bytes, 4, "xxh3-64", leaves or (leaf(),), "tree")


@pytest.mark.parametrize("m, match", [
    (manifest(leaf(shards=((TOP, 16), (TOP, 16)))), r"leaf 'w' of version 1 of 'm': shards \[0:2, 0:2\] and "
                                                    r"\[0:2, 0:2\] overlap"),
    (manifest(leaf(shards=((TOP, 16),))), "leaf 'w' .* cover 4 of its 8 elements"),
    (manifest(leaf(shards=((TOP, 16), (BOTTOM, 24)))), r"shard \[2:4, 0:2\] hold 24 bytes .* it needs 16"),
    (manifest(leaf(shards=((TOP, 16), (BOTTOM, 8)))), r"shard \[2:4, 0:2\] hold 8 bytes"),
    (manifest(leaf(shape=(512,), shards=((((0, 512),), 2048),))), "in 1 blocks of at most 1024; it needs 2048"),
    (manifest(leaf(), leaf()), "leaf 'w' appears twice"),
    (manifest(leaf(dtype="complex64")), "no array tpusync publishes"),
])
def test_check_manifest_names_the_leaf_and_the_shards(m, match):
    with pytest.raises(errors.CorruptionError, match=match):
        check_manifest(m)


def test_a_part_need_not_cover_but_must_not_overlap():
    check_manifest(manifest(leaf(shards=((TOP, 16),))), whole=False)
    with pytest.raises(errors.CorruptionError, match="overlap"):
        check_manifest(manifest(leaf(shards=((TOP, 16), (TOP, 16)))), whole=False)


def test_parts_that_overlap_each_other_are_refused():
    """Two parts holding different, overlapping shards whose elements add up to the leaf's:
    rows 1 and 2 twice, row 3 in no part."""
    a = manifest(leaf(shards=((((0, 2), (0, 2)), 16),)))
    b = manifest(leaf(shards=((((1, 3), (0, 2)), 16),)))
    with pytest.raises(errors.CorruptionError, match=r"do not tile leaf 'w': shards \[0:2, 0:2\] and \[1:3, 0:2\]"):
        merge_parts([a, b])


# -- on a store: every reader refuses such a version ------------------------------------------

@pytest.fixture
def store(local_store):
    return local_store(16 << 20, 64 << 10)


W1 = np.arange(8, dtype=np.float32).reshape(4, 2)


def commit_raw(store, m: Manifest) -> None:
    """Stores a manifest and its commit record as any writer could (write_manifest refuses to)."""
    record, parts = manifest_blocks(m)
    store.put([k for k, _ in parts], [p for _, p in parts])
    store.put([ref_key(m.model, m.version)], [encode_commit(record)])
    store.put([commit_key(m.model, m.version)], [encode_commit(record)])


def overlapping_version(store, version: int) -> Manifest:
    """Version `version` of 'm' whose leaf 'w' lists its top half twice: its bottom half is in
    no shard, though the shards' elements add up to the leaf's."""
    top = np.ascontiguousarray(W1[:2] + 100).view(np.uint8).reshape(-1)
    key = weight_key("m", version, "data", "w", [list(d) for d in TOP], 0, checksum(top))
    store.put([key], [top.tobytes()])
    ref = BlockRef(key, top.size, checksum(top))
    m = Manifest("m", version, store.block_bytes, 8, "xxh3-64",
                 (LeafEntry("w", (4, 2), "float32", "host", (ShardEntry(TOP, (ref,)), ShardEntry(TOP, (ref,)))),))
    commit_raw(store, m)
    return m


def test_a_sampler_refuses_a_version_with_overlapping_shards_and_keeps_its_own(store):
    VersionedWeights(store, "m").publish({"w": W1}, 1)
    overlapping_version(store, 2)

    sampler = VersionedWeights(store, "m")
    sampler.bind_weights({"w": np.zeros((4, 2), np.float32)})
    assert sampler.wait_for_version(1, timeout=5) == 1  # the newest good one: 2 is refused
    with pytest.raises(errors.CorruptionError, match=r"leaf 'w' of version 2 of 'm': shards \[0:2, 0:2\] and "
                                                     r"\[0:2, 0:2\] overlap"):
        sampler.wait_for_version(2, timeout=5)
    assert sampler.version == 1
    assert np.array_equal(sampler.params["w"], W1)
    with pytest.raises(errors.CorruptionError, match="overlap"):
        read_manifest(store, "m", 2)


def test_an_engine_never_pins_or_loads_such_a_version(store):
    """The in-place path (vLLM's backend, tpu-inference's extension): await_version skips
    it, and asking for it by number raises before anything is pinned or loaded."""
    VersionedWeights(store, "m").publish({"w": W1}, 1)
    overlapping_version(store, 2)
    assert await_version(store, "m", None, 5) == 1
    with pytest.raises(errors.CorruptionError, match="overlap"):
        await_version(store, "m", 2, 5)
    with pytest.raises(errors.CorruptionError, match="overlap"), pinned_version(store, "m", 2):
        pass


def test_a_version_whose_blocks_claim_more_than_its_shard_is_refused(store):
    """A one-shard leaf whose block's length runs past the shard's bytes (the in-place path
    would view it as the leaf)."""
    m = VersionedWeights(store, "m").publish({"w": W1}, 1)
    ref = m.leaves[0].shards[0].blocks[0]
    long = dataclasses.replace(m, version=2, leaves=(dataclasses.replace(m.leaves[0], shards=(
        ShardEntry(((0, 4), (0, 2)), (dataclasses.replace(ref, length=ref.length + 8),)),)),))
    commit_raw(store, long)
    with pytest.raises(errors.CorruptionError, match=r"shard \[0:4, 0:2\] hold 40 bytes .* it needs 32"):
        await_version(store, "m", 2, 5)


def test_no_writer_stores_a_manifest_that_is_no_tiling(store):
    with pytest.raises(errors.CorruptionError, match="overlap"):
        write_manifest(store, manifest(leaf(shards=((TOP, 16), (TOP, 16)))))
    assert read_manifest(store, "m", 1) is None
    shard = W1[:2].copy()
    with pytest.raises(errors.InvalidArgumentError, match=r"leaf 'w': shards \[0:2, 0:2\] and \[0:2, 0:2\] overlap"):
        VersionedWeights(store, "m").publish({"w": [Shard(shard, (4, 2), (0, 0)), Shard(shard, (4, 2), (0, 0))]}, 1)
    with pytest.raises(errors.InvalidArgumentError, match="overlap"):
        VersionedWeights(store, "m").publish({"w": [Shard(shard, (4, 2), (0, 0)), Shard(shard, (4, 2), (1, 0))]}, 1,
                                             part=(0, 2))
    assert read_manifest(store, "m", 1) is None
