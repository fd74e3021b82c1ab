"""merge_parts: a multi-process trainer's part manifests make one version only when together
they cover every leaf, and two parts holding the same shard must agree on its blocks."""

from __future__ import annotations

import pytest

from tpusync import errors
from tpusync.weights.manifest import BlockRef, LeafEntry, Manifest, ShardEntry, merge_parts


def part(*shards, name="w", shape=(4, 2)):
    leaf = LeafEntry(name, shape, "float32", "sharded", tuple(
        ShardEntry(index, (BlockRef(key, 16, key),)) for index, key in shards))
    return Manifest("m", 1, 1024, 4, "xxh3-64", (leaf,), "tree")


TOP, BOTTOM = ((0, 2), (0, 2)), ((2, 4), (0, 2))


def test_parts_merge_into_the_whole_version_in_index_order():
    whole = merge_parts([part((BOTTOM, 2)), part((TOP, 1))])
    assert [s.index for s in whole.leaf("w").shards] == [TOP, BOTTOM]
    assert [b.key for b in whole.blocks()] == [1, 2]


def test_a_shard_held_by_two_parts_counts_once():
    whole = merge_parts([part((TOP, 1), (BOTTOM, 2)), part((BOTTOM, 2))])
    assert [b.key for b in whole.blocks()] == [1, 2]


def test_a_missing_part_is_refused():
    with pytest.raises(errors.PreconditionError, match="cover 4 of 8 elements of leaf 'w'"):
        merge_parts([part((TOP, 1))])


def test_parts_that_disagree_are_refused():
    with pytest.raises(errors.CorruptionError, match="different data for shard"):
        merge_parts([part((TOP, 1), (BOTTOM, 2)), part((BOTTOM, 3))])
    with pytest.raises(errors.CorruptionError, match="shape/dtype"):
        merge_parts([part((TOP, 1)), part((BOTTOM, 2), shape=(4, 4))])
