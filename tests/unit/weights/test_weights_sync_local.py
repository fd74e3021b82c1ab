"""Manifest format, keys, head and the synchronizer on an in-process store (no sidecar)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tpusync
from tests.torn_reads import TornReadWatcher
from tpusync.weights import TemplateMismatchError, VersionedWeights
from tpusync.weights.codec import decode_manifest, encode_manifest, manifest_blocks
from tpusync.weights.head import advance_head, read_head
from tpusync.weights.keys import commit_key, weight_key
from tpusync.weights.manifest import Manifest
from tpusync.weights.storage import read_commit, read_manifest, version_keys

BLOCK = 64 << 10


@pytest.fixture
def store(local_store):
    return local_store(64 << 20, BLOCK)


def params(seed: int):
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.standard_normal((300, 256)).astype(ml_dtypes.bfloat16)),  # 150 KiB: 3 blocks
        "layers": [{"w": jnp.asarray(rng.standard_normal((64, 64)).astype(np.float32)),
                    "b": jnp.asarray(rng.integers(-128, 127, 17, dtype=np.int8))} for _ in range(2)],
        "host": rng.standard_normal(5),
    }


def same_bytes(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def assert_tree_equal(want, got):
    wl, gl = jax.tree.leaves(want), jax.tree.leaves(got)
    assert len(wl) == len(gl)
    for i, (w, g) in enumerate(zip(wl, gl)):
        assert same_bytes(w, g), f"leaf {i} differs"


def test_keys_never_collide_across_models_versions_leaves():
    keys = {weight_key(m, v, "data", leaf, 0, 0) for m in ("a", "b") for v in (1, 2) for leaf in ("x", "y")}
    keys |= {commit_key(m, v) for m in ("a", "b") for v in (1, 2)}
    assert len(keys) == 12 and all(0 <= k < 1 << 128 for k in keys)


def test_manifest_round_trips_and_splits_over_blocks(store):
    m = VersionedWeights(store, "m", blocks_per_chunk=2).publish(params(0), 1)
    assert decode_manifest(encode_manifest(m)) == m
    record, parts = manifest_blocks(m)
    assert len(parts) == 1 and record.parts == (parts[0][0],)
    small = Manifest(m.model, m.version, 64, 2, m.checksum, m.leaves, m.treedef)
    _, small_parts = manifest_blocks(small)
    assert len(small_parts) > 10 and all(len(p) <= 64 for _, p in small_parts)
    assert read_manifest(store, "m", 1) == m
    assert [len(c) for c in m.chunks()][:1] == [2] and sum(len(c) for c in m.chunks()) == len(m.blocks())
    assert {leaf.name for leaf in m.leaves} == {"embed", "layers/0/w", "layers/0/b", "layers/1/w", "layers/1/b", "host"}
    assert m.leaf("embed").dtype == "bfloat16" and len(m.leaf("embed").shards[0].blocks) == 3


def test_head_only_moves_forward(shm_path):
    assert read_head(shm_path, "m") is None
    assert advance_head(shm_path, "m", 3) is None
    assert advance_head(shm_path, "m", 2) == 3 and read_head(shm_path, "m") == 3
    assert advance_head(shm_path, "m", 5) == 3 and read_head(shm_path, "m") == 5
    assert read_head(shm_path, "other") is None
    import shutil

    shutil.rmtree(shm_path + ".weights")


def test_publish_then_receive_byte_exact_with_bf16(store):
    trainer, sampler = VersionedWeights(store, "m"), VersionedWeights(store, "m")
    p1 = params(1)
    trainer.publish(p1, 1)
    sampler.bind_weights(p1)
    assert sampler.poll() == 1 and sampler.poll() is None
    assert_tree_equal(p1, sampler.params)
    assert isinstance(sampler.params["host"], np.ndarray)  # host leaves stay host arrays
    assert sampler.params["embed"].dtype == jnp.bfloat16
    host = sampler.get_host_buffer()
    assert same_bytes(host["embed"], p1["embed"]) and not host["embed"].flags.writeable
    m = sampler.get_metrics()
    assert m["version"] == 1 and m["versions_loaded"] == 1 and m["zero_copy_leaves"] >= 4
    assert m["host"]["pinned"] == len(version_keys(read_manifest(store, "m", 1)))


def test_versions_swap_and_old_pins_are_released(store):
    trainer, sampler = VersionedWeights(store, "m"), VersionedWeights(store, "m")
    sampler.bind_weights(params(0))
    for v in (1, 2, 3):
        trainer.publish(params(v), v)
        assert sampler.wait_for_version(v, timeout=5) == v
        assert_tree_equal(params(v), sampler.params)
    assert store.stats()["pinned"] == len(version_keys(read_manifest(store, "m", 3)))


def test_republishing_a_committed_version_is_refused(store):
    trainer = VersionedWeights(store, "m")
    trainer.publish(params(1), 1)
    with pytest.raises(tpusync.PreconditionError, match="already committed"):
        trainer.publish(params(2), 1)


def test_an_interrupted_publish_leaves_the_previous_version_in_force(store):
    trainer, sampler = VersionedWeights(store, "m"), VersionedWeights(store, "m")
    trainer.publish(params(1), 1)

    def die(done, total):
        if done == total // 2:
            raise KeyboardInterrupt("trainer killed")

    with pytest.raises(KeyboardInterrupt):
        trainer.publish(params(2), 2, on_block=die)
    assert trainer.latest_version() == 1 and read_commit(store, "m", 2) is None
    sampler.bind_weights(params(0))
    assert sampler.poll() == 1
    assert_tree_equal(params(1), sampler.params)
    with pytest.raises(tpusync.errors.DeadlineExceededError, match="version 2"):
        sampler.wait_for_version(2, timeout=0.05)
    trainer.publish(params(2), 2)  # a restarted trainer finishes it; the first half is reused
    assert sampler.wait_for_version(2, timeout=5) == 2
    assert_tree_equal(params(2), sampler.params)


@pytest.mark.parametrize("change, match", [
    (lambda t: t["layers"][1].update(w=jnp.zeros((64, 32), jnp.float32)),
     r"leaf 'layers/1/w': the template has shape \(64, 32\)"),
    (lambda t: t.update(embed=jnp.zeros((300, 256), jnp.float32)),
     r"leaf 'embed': the template has dtype float32, .* has bfloat16"),
    (lambda t: t.update(extra=jnp.zeros(3)), r"leaf 'extra' is in the template but not in version 1"),
    (lambda t: t.pop("host"), r"leaf 'host' is in version 1 of 'm' but not in the template"),
])
def test_mismatched_template_names_the_leaf(store, change, match):
    VersionedWeights(store, "m").publish(params(1), 1)
    template = params(0)
    change(template)
    sampler = VersionedWeights(store, "m")
    sampler.bind_weights(template)
    with pytest.raises(TemplateMismatchError, match=match):
        sampler.poll()
    assert sampler.version is None and sampler.params is None


def test_a_reader_never_sees_a_torn_version(store):
    """Each version fills every leaf with its number; a reader checks every pair it reads."""
    trainer, sampler = VersionedWeights(store, "m"), VersionedWeights(store, "m")
    shapes = {f"l{i}": (40_000 * (i + 1),) for i in range(6)}  # leaves of 1 to 4 blocks

    def version(v):
        return {k: jnp.full(s, v, jnp.float32) for k, s in shapes.items()}

    sampler.bind_weights(version(0))
    with TornReadWatcher(sampler) as reader:
        for v in range(1, 9):
            trainer.publish(version(v), v)
            sampler.wait_for_version(v, timeout=10)
            assert reader.saw(v)  # the reader observed this version before the next swap
    assert not reader.torn
    assert reader.seen == set(range(1, 9))


def test_resharding_between_meshes_through_host_buffers(tmp_path):
    """A trainer sharded 4-ways on rows publishes; a sampler wants 2x2 shards (same shape)."""
    script = textwrap.dedent(f"""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        import jax, jax.numpy as jnp, numpy as np, ml_dtypes, tpusync
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from tpusync.weights import VersionedWeights
        devs = np.array(jax.devices())
        store = tpusync.KVStore.local(dram_bytes=32 << 20, block_bytes={BLOCK})
        x = np.random.default_rng(0).standard_normal((64, 1024)).astype(ml_dtypes.bfloat16)
        train = NamedSharding(Mesh(devs, ("d",)), P("d", None))
        serve = NamedSharding(Mesh(devs.reshape(2, 2), ("a", "b")), P("b", "a"))
        rep = NamedSharding(Mesh(devs, ("d",)), P())
        params = {{"w": jax.device_put(x, train), "r": jax.device_put(x[:4], rep)}}
        m = VersionedWeights(store, "m").publish(params, 1)
        assert len(m.leaf("w").shards) == 4, m.leaf("w").shards  # one entry per shard
        assert len(m.leaf("r").shards) == 1  # replicas published once
        sampler = VersionedWeights(store, "m")
        sampler.bind_weights({{"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=serve),
                              "r": jax.ShapeDtypeStruct((4, 1024), x.dtype, sharding=serve)}})
        assert sampler.poll() == 1
        w = sampler.params["w"]
        assert w.sharding == serve and len(w.addressable_shards) == 4
        assert np.asarray(w).tobytes() == x.tobytes()
        for s in w.addressable_shards:
            assert np.asarray(s.data).tobytes() == np.ascontiguousarray(x[s.index]).tobytes()
        assert np.asarray(sampler.params["r"]).tobytes() == x[:4].tobytes()
        store.close()
        print("RESHARD-OK")
    """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=240,
                         env=env)
    assert "RESHARD-OK" in out.stdout, out.stderr[-3000:]
