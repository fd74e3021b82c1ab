"""Versions for engines loaded in place (weights/inplace.py), numpy shards (weights/tensors.py) and
the weights an engine serves (vllm/served_weights.py), on an in-process store."""

from __future__ import annotations

import numpy as np
import pytest

from tpusync import errors
from tpusync.kv import served_weights
from tpusync.weights import Shard, VersionedWeights
from tpusync.weights.inplace import await_version, pinned_version
from tpusync.weights.leaves import leaf_bytes
from tpusync.weights.storage import commit_on_host, read_manifest, version_keys
from tpusync.weights.tensors import dtype_name, host_leaf

BLOCK = 4096


@pytest.fixture
def store(local_store):
    return local_store(8 << 20, BLOCK)


def pushed(store, model: str, versions: list[int]) -> None:
    """Versions stored with their commit records and no head: what a peer's push leaves."""
    from tpusync.weights.head import head_path

    sync = VersionedWeights(store, model)
    for v in versions:
        sync.publish({"w": np.full(3000, v, np.float32)}, v)
    import os

    os.unlink(head_path(store.pool_path, model))  # as if pushed: records here, no head


def test_await_version_commits_pushed_versions_and_returns_the_newest(store):
    pushed(store, "m", [1, 2, 3])
    assert await_version(store, "m", 2, timeout=0) == 3
    assert await_version(store, "m", None, timeout=0) == 3


def test_await_version_that_never_arrives_names_what_the_host_has(store):
    VersionedWeights(store, "m").publish({"w": np.zeros(10, np.float32)}, 1)
    with pytest.raises(errors.DeadlineExceededError, match=r"version 5 of 'm' did not arrive .* host has 1"):
        await_version(store, "m", 5, timeout=0)


def test_pinned_version_holds_its_blocks_against_eviction(store):
    sync = VersionedWeights(store, "m")
    sync.publish({"w": np.arange(3000, dtype=np.float32)}, 1)
    with pinned_version(store, "m", 1) as manifest:
        keys = version_keys(manifest)
        store.release(keys, for_host=True)  # as when a newer version's commit unpins this one
        with pytest.raises(errors.PreconditionError, match="pinned"):
            store.evict(keys)
        got = leaf_bytes(store, manifest.leaf("w"), verify=True).view(np.float32)
        assert np.array_equal(got, np.arange(3000, dtype=np.float32))
    store.evict(keys)
    assert store.lookup(keys).prefix_len == 0


def test_numpy_shards_publish_and_assemble(store):
    full = np.arange(40, dtype=np.int16).reshape(5, 8)
    sync = VersionedWeights(store, "s")
    sync.publish({"x": [Shard(full[:, 5:], (5, 8), (0, 5)), Shard(full[:, :5], (5, 8), (0, 0))]}, 1)
    manifest = read_manifest(store, "s", 1)
    commit_on_host(store, manifest)
    assert np.array_equal(leaf_bytes(store, manifest.leaf("x"), verify=True).view(np.int16).reshape(5, 8), full)


def test_dtype_names_are_the_frameworks_common_ones():
    import ml_dtypes

    assert dtype_name(np.zeros(1, ml_dtypes.bfloat16)) == "bfloat16"
    assert host_leaf("a", np.zeros((2, 3), np.float32)).dtype == "float32"
    with pytest.raises(errors.InvalidArgumentError, match="complex64"):
        dtype_name(np.zeros(1, np.complex64))


def test_served_weights_tag_follows_the_recorded_version(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read $TMPDIR
    engine = "engine-under-test"
    served_weights.forget(engine)
    view = served_weights.ServedWeights(engine)
    assert view.tag() is None                       # the weights it started with: plain keys
    view.reset()
    reset_tag = view.tag()
    assert reset_tag is not None and reset_tag.startswith("epoch:")  # another backend's update: keyed apart
    served_weights.record(engine, "policy@3:x")
    assert view.tag() == "policy@3:x"
    served_weights.record(engine, "policy@4:y")
    assert view.tag() == "policy@4:y"
    served_weights.forget(engine)
    assert view.tag() == reset_tag
