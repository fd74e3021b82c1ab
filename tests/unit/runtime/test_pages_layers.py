"""Copying pages of a list-of-layers KV cache (one jax.Array per layer, the page axis first:
tpu-inference's layout) between the layers and store blocks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import tpusync
from tests.support.host_devices import run_on_four_devices
from tpusync.pages import layer_block_bytes, load_layer_pages, save_layer_pages

# tpu-inference's per-layer shape: pages, page_size, heads x2 / packing, packing, head_dim
SHAPES = [(6, 4, 2, 1, 8), (6, 4, 2, 1, 8), (6, 4, 1, 2, 8)]


def layers(dtype, seed):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s).astype(np.float32)).astype(dtype) for s in SHAPES]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_layer_pages_round_trip_bit_exact(dtype):
    src = layers(dtype, 1)
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        written = save_layer_pages(store, [10, 11, 12], src, [1, 3, 5])
        assert written == 3 * layer_block_bytes(src) == 3 * 3 * 64 * jnp.dtype(dtype).itemsize
        assert save_layer_pages(store, [10], src, [1]) == 0  # stored already: content-addressed
        dst, loaded = load_layer_pages(store, [10, 11, 12], [jnp.zeros(s, dtype) for s in SHAPES], [0, 2, 4])
    assert loaded == 3
    for a, b in zip(src, dst):
        for s, d in ((1, 0), (3, 2), (5, 4)):
            assert np.array_equal(np.asarray(b[d]).view(np.uint8), np.asarray(a[s]).view(np.uint8))
        assert not np.asarray(b[1]).any()  # other pages untouched


def test_layer_load_stops_at_the_first_missing_block():
    src = layers(jnp.float32, 2)
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        save_layer_pages(store, [1, 3], src, [0, 2])
        dst, loaded = load_layer_pages(store, [1, 2, 3], [jnp.zeros(s) for s in SHAPES], [0, 1, 2])
    assert loaded == 1
    assert not np.asarray(dst[0][2]).any()


def test_a_block_too_small_for_a_page_of_every_layer_is_refused():
    big = [jnp.zeros((2, 64, 2, 1, 8))] * 3
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store, \
            pytest.raises(tpusync.InvalidArgumentError, match="12288 bytes"):
        save_layer_pages(store, [1], big, [0])


SHARDED = """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tpusync
    from tpusync.pages import load_layer_pages, save_layer_pages, shard_key
    shape = (4, 4, 4, 1, 8)  # pages, page_size, heads x2 (sharded on "model", as tpu-inference does), packing, dim
    devs = np.array(jax.devices())
    sharding = NamedSharding(Mesh(devs[:2], ("model",)), P(None, None, "model", None, None))
    src = [jax.device_put(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * (i + 1), sharding)
           for i in range(2)]
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        save_layer_pages(store, [7, 8], src, [0, 3])
        assert store.stats()["blocks"] == 4, store.stats()  # one block per shard
        assert store.lookup([shard_key(7, n, 2) for n in range(2)]).prefix_len == 2
        zeros = [jax.device_put(jnp.zeros(shape), sharding) for _ in range(2)]
        dst, n = load_layer_pages(store, [7, 8], zeros, [1, 2])
    assert n == 2 and all(d.sharding == sharding for d in dst)
    for a, b in zip(src, dst):
        assert np.array_equal(np.asarray(b[1]), np.asarray(a[0])) and np.array_equal(np.asarray(b[2]), np.asarray(a[3]))
        assert not np.asarray(b[0]).any()
    bad = [jax.device_put(jnp.zeros(shape), NamedSharding(Mesh(devs[:2], ("p",)), P("p")))]
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        try:
            save_layer_pages(store, [7], bad, [0])
        except tpusync.InvalidArgumentError as e:
            assert "pages axis (axis 0) is sharded" in str(e)
        else:
            raise AssertionError("a cache sharded over pages was accepted")
    print("ok")
    """


def test_sharded_layers_move_shard_by_shard():
    run_on_four_devices(SHARDED)



RESHARDED = """
    import itertools
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tpusync
    from tpusync.pages import load_layer_pages_resharded, save_layer_pages, shard_key
    shape = (5, 4, 8, 1, 16)  # pages, page_size, heads x2 (split on "model"), packing, dim
    devs = np.array(jax.devices())

    def split(n):
        return NamedSharding(Mesh(devs[:n], ("model",)), P(None, None, "model", None, None))

    src = [jnp.asarray(np.random.default_rng(i).normal(size=shape).astype(np.float32)) for i in range(3)]
    for stored, loading in itertools.product((1, 2, 4), (1, 2, 4)):
        with tpusync.KVStore.local(dram_bytes=256 * 8192, block_bytes=8192) as store:
            save_layer_pages(store, [7, 8, 9], [jax.device_put(a, split(stored)) for a in src], [0, 3, 4])
            store.evict([shard_key(9, stored - 1, stored)])  # the last block lacks one part
            zeros = [jax.device_put(jnp.zeros(shape), split(loading)) for _ in src]
            dst, n = load_layer_pages_resharded(store, [7, 8, 9], zeros, [1, 2, 4], stored, axis=2)
        assert n == 2, (stored, loading, n)
        assert all(d.sharding == split(loading) for d in dst)
        for a, b in zip(src, dst):
            assert np.array_equal(np.asarray(b[1]), np.asarray(a[0])), (stored, loading)
            assert np.array_equal(np.asarray(b[2]), np.asarray(a[3])), (stored, loading)
            assert not np.asarray(b[0]).any() and not np.asarray(b[4]).any()
    with tpusync.KVStore.local(dram_bytes=256 * 8192, block_bytes=8192) as store:
        save_layer_pages(store, [7], [jax.device_put(a, split(4)) for a in src], [0])
        dst, n = load_layer_pages_resharded(store, [7], [jnp.zeros(shape) for _ in src], [0], 2, axis=2)
        assert n == 0  # stored in 4 parts, asked for 2: other keys, nothing taken for what it is not
        try:
            load_layer_pages_resharded(store, [7], [jnp.zeros(shape) for _ in src], [0], 3, axis=2)
        except tpusync.InvalidArgumentError as e:
            assert "cannot be split in 3" in str(e)
        else:
            raise AssertionError("3 parts of 8 heads accepted")
    print("ok")
    """


def test_a_cache_split_otherwise_loads_what_each_shard_overlaps():
    """Tensor parallelism of another degree: blocks stored in 1, 2 or 4 parts along the head
    axis load bit-exact into a cache split in 1, 2 or 4, a block missing a part ends the run,
    and parts of another split are never taken for the asked one."""
    run_on_four_devices(RESHARDED)


PAGED = """
    import itertools
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tpusync
    from tpusync.pages import load_layer_pages_resharded, save_layer_pages, shard_key
    devs = np.array(jax.devices())
    TOKENS, HEADS, DIM, PAGES = 32, 8, 4, 16

    def split(n):
        return NamedSharding(Mesh(devs[:n], ("model",)), P(None, None, "model", None, None))

    # Two layers' KV of one 32-token prompt, [tokens, heads, packing, dim]
    stream = [np.random.default_rng(i).normal(size=(TOKENS, HEADS, 1, DIM)).astype(np.float32) for i in range(2)]

    def cache(page, shards):  # the prompt in pages 0.. of a cache of `page`-token pages
        out = []
        for s in stream:
            a = np.zeros((PAGES, page, HEADS, 1, DIM), np.float32)
            a[:TOKENS // page] = s.reshape(TOKENS // page, page, HEADS, 1, DIM)
            out.append(jax.device_put(jnp.asarray(a), split(shards)))
        return out

    for stored_page, stored, page, loading in itertools.product((4, 8), (1, 2), (2, 4, 16), (1, 4)):
        case = (stored_page, stored, page, loading)
        start = page  # the loading engine holds its first page already
        first = start // stored_page
        keys = [100 + b for b in range(TOKENS // stored_page)]
        wanted = (TOKENS - start) // page
        pids = [PAGES - 1 - j for j in range(wanted)]
        with tpusync.KVStore.local(dram_bytes=512 * 4096, block_bytes=4096) as store:
            save_layer_pages(store, keys, cache(stored_page, stored), list(range(TOKENS // stored_page)))
            store.evict([shard_key(keys[-1], stored - 1, stored)])  # the last block lacks a part
            zeros = [jax.device_put(jnp.zeros((PAGES, page, HEADS, 1, DIM)), split(loading)) for _ in stream]
            dst, n = load_layer_pages_resharded(store, keys[first:], zeros, pids, stored, axis=2,
                                                src_page_tokens=stored_page, first_token=start - first * stored_page)
        assert n == max(0, (TOKENS - stored_page - start) // page), (case, n)  # pages before the last block
        for s, b in zip(stream, dst):
            for j in range(wanted):
                got = np.asarray(b[pids[j]])
                if j < n:
                    assert np.array_equal(got, s[start + j * page:start + (j + 1) * page]), (case, j)
                else:
                    assert not got.any(), (case, j)
    print("ok")
    """


def test_blocks_of_another_page_size_load_the_tokens_each_page_overlaps():
    """Page size and tensor parallelism both other than the storing engine's: blocks of 4 or 8
    tokens in 1 or 2 parts load bit-exact into pages of 2, 4 or 16 tokens split in 1 or 4,
    from the middle of a stored block, and a block missing a part ends the run before the
    first page that needs it."""
    run_on_four_devices(PAGED)


def test_page_ranges_cover_the_page_once():
    from tpusync.pages import page_ranges

    assert page_ranges(32, 16, 0, 0) == [(0, 0, 0, 16), (1, 0, 16, 16)]
    assert page_ranges(32, 16, 0, 1) == [(2, 0, 0, 16), (3, 0, 16, 16)]
    assert page_ranges(16, 32, 16, 0) == [(0, 16, 0, 16)]
    assert page_ranges(16, 32, 16, 1) == [(1, 0, 0, 16)]
    assert page_ranges(16, 16, 0, 2) == [(2, 0, 0, 16)]


def test_reshard_ranges_cover_the_target_once():
    from tpusync.pages import reshard_ranges

    assert reshard_ranges(8, 2, (0, 4)) == [(0, 0, 0, 4)]
    assert reshard_ranges(8, 4, (0, 4)) == [(0, 0, 0, 2), (1, 0, 2, 2)]
    assert reshard_ranges(8, 1, (4, 6)) == [(0, 4, 0, 2)]
    assert reshard_ranges(8, 4, (3, 7)) == [(1, 1, 0, 1), (2, 0, 1, 2), (3, 0, 3, 1)]


class _DropsAfter:
    """A real store whose connection drops after `good` acquire_many calls."""

    def __init__(self, store, good: int) -> None:
        self.store, self.good = store, good
        self.block_bytes = store.block_bytes

    def acquire_many(self, keys):
        from tpusync import errors

        if self.good == 0:
            raise errors.UnavailableError("sidecar gone")
        self.good -= 1
        return self.store.acquire_many(keys)


def test_a_store_error_after_a_loaded_group_hands_back_the_new_layers():
    """Each group's update donates the layers it was given: once one group is in, a store error
    must not leave the caller holding deleted arrays (it gets the new ones and the count)."""
    from tpusync import errors, pages

    shape = (40, 4, 2, 1, 8)
    src = [jnp.asarray(np.arange(np.prod(shape), dtype=np.float32).reshape(shape))]
    keys, pids = list(range(100, 120)), list(range(20))  # two groups of pages
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        save_layer_pages(store, keys, src, pids)
        dst, loaded = load_layer_pages(_DropsAfter(store, 1), keys, [jnp.zeros(shape, jnp.float32)],
                                       [p + 20 for p in pids])
        assert loaded == pages._GROUP
        assert np.array_equal(np.asarray(dst[0][20:20 + loaded]), np.asarray(src[0][:loaded]))
        with pytest.raises(errors.UnavailableError):  # nothing loaded yet: the error is the caller's
            load_layer_pages(_DropsAfter(store, 0), keys, [jnp.zeros(shape, jnp.float32)], pids)
