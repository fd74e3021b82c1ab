"""Copying KV-cache pages between jax.Arrays and store blocks (`tpusync.kv.pages`): one API over a
list of layers, each with a pages axis, for tpu-inference's layout (one array per layer, pages
first) and the reference engine's (`[k, v]`, each `[layers, pages, page_size, kv_heads,
head_dim]`: the two-layer case, pages on axis 1). A block holds one page of every layer."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import pytest

import tpusync
from harness.host_devices import run_on_four_devices
from tpusync import errors
from tpusync.kv import pages
from tpusync.kv.pages import block_bytes, load_pages, page_ranges, reshard_ranges, save_pages, shard_number


@dataclass(frozen=True)
class Layout:
    """A cache layout: the layers' shapes and where their pages axis is."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    page_axis: int

    def layers(self, dtype=jnp.float32, seed: int | None = None, pages: int | None = None) -> list:
        rng = np.random.default_rng(seed)
        out = []
        for shape in self.shapes:
            s = shape if pages is None else shape[:self.page_axis] + (pages,) + shape[self.page_axis + 1:]
            out.append(jnp.zeros(s, dtype) if seed is None else
                       jnp.asarray(rng.normal(size=s).astype(np.float32)).astype(dtype))
        return out

    def page(self, layer, p: int) -> np.ndarray:
        return np.take(np.asarray(layer), p, axis=self.page_axis)

    def page_bytes(self, dtype) -> int:
        return sum(int(np.prod(s)) // s[self.page_axis] for s in self.shapes) * jnp.dtype(dtype).itemsize


LAYOUTS = [
    # tpu-inference's per-layer shape: pages, page_size, heads x2 / packing, packing, head_dim
    Layout("layers", ((6, 4, 2, 1, 8), (6, 4, 2, 1, 8), (6, 4, 1, 2, 8)), 0),
    # the reference engine's [k, v]: layers, pages, page_size, kv_heads, head_dim
    Layout("k-v", ((3, 6, 4, 2, 8), (3, 6, 4, 2, 8)), 1),
]
each_layout = pytest.mark.parametrize("lay", LAYOUTS, ids=[lay.name for lay in LAYOUTS])


@each_layout
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8])
def test_pages_round_trip_bit_exact(lay, dtype):
    src = lay.layers(dtype, 1)
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        written = save_pages(store, [10, 11, 12], src, [1, 3, 5], page_axis=lay.page_axis)
        assert written == 3 * block_bytes(src, page_axis=lay.page_axis) == 3 * lay.page_bytes(dtype)
        assert save_pages(store, [10], src, [1], page_axis=lay.page_axis) == 0  # stored already: content-addressed
        dst, loaded = load_pages(store, [10, 11, 12], lay.layers(dtype), [0, 2, 4], page_axis=lay.page_axis)
    assert loaded == 3
    for a, b in zip(src, dst):
        for s, d in ((1, 0), (3, 2), (5, 4)):
            assert np.array_equal(lay.page(b, d).view(np.uint8), lay.page(a, s).view(np.uint8))
        assert not lay.page(b, 1).any()  # other pages untouched


@each_layout
def test_load_stops_at_the_first_missing_block(lay):
    src = lay.layers(jnp.float32, 2)
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        save_pages(store, [1, 3], src, [0, 2], page_axis=lay.page_axis)
        dst, loaded = load_pages(store, [1, 2, 3], lay.layers(), [0, 1, 2], page_axis=lay.page_axis)
    assert loaded == 1
    assert not lay.page(dst[0], 2).any()


@each_layout
@pytest.mark.parametrize("length", [lambda page: 100, lambda page: page - 1, lambda page: page + 1,
                                    lambda page: 4096], ids=["short", "a byte short", "a byte long", "a whole block"])
def test_load_stops_at_the_first_block_of_another_length(lay, length):
    """A block stored with the wrong length is a miss: never loaded in part, nor with trailing bytes."""
    src = lay.layers(jnp.float32, 3)
    length = length(lay.page_bytes(jnp.float32))
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        store.put([2], [np.full(length, 7, np.uint8)])
        save_pages(store, [1, 2, 3], src, [0, 1, 2], page_axis=lay.page_axis)  # 2 is stored already: kept as it is
        dst, loaded = load_pages(store, [1, 2, 3], lay.layers(), [0, 1, 2], page_axis=lay.page_axis)
    assert loaded == 1
    assert np.array_equal(lay.page(dst[0], 0), lay.page(src[0], 0))
    assert not lay.page(dst[0], 1).any() and not lay.page(dst[0], 2).any()


@each_layout
def test_a_block_too_small_for_a_page_of_every_layer_is_refused(lay):
    big = lay.layers(pages=2)
    big = [jnp.zeros(a.shape[:lay.page_axis + 1] + (64,) + a.shape[lay.page_axis + 2:]) for a in big]
    want = sum(int(np.prod(a.shape)) // 2 for a in big) * 4
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store, \
            pytest.raises(tpusync.InvalidArgumentError, match=f"{want} bytes"):
        save_pages(store, [1], big, [0], page_axis=lay.page_axis)


class _DropsAfter:
    """A real store whose connection drops after `good` acquire_many calls."""

    def __init__(self, store, good: int) -> None:
        self.store, self.good = store, good
        self.block_bytes = store.block_bytes

    def acquire_many(self, keys):
        if self.good == 0:
            raise errors.UnavailableError("sidecar gone")
        self.good -= 1
        return self.store.acquire_many(keys)


@each_layout
def test_a_store_error_after_a_loaded_group_hands_back_the_new_layers(lay):
    """Each group's update donates the layers it was given: once one group is in, a store error
    must not leave the caller holding deleted arrays (it gets the new ones and the count)."""
    src = lay.layers(jnp.float32, 4, pages=40)
    keys, pids = list(range(100, 120)), list(range(20))  # two groups of pages
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        save_pages(store, keys, src, pids, page_axis=lay.page_axis)
        dst, loaded = load_pages(_DropsAfter(store, 1), keys, lay.layers(pages=40), [p + 20 for p in pids],
                                 page_axis=lay.page_axis)
        assert loaded == pages._GROUP
        for a, b in zip(src, dst):
            assert all(np.array_equal(lay.page(b, 20 + p), lay.page(a, p)) for p in range(loaded))
        with pytest.raises(errors.UnavailableError):  # nothing loaded yet: the error is the caller's
            load_pages(_DropsAfter(store, 0), keys, lay.layers(pages=40), pids, page_axis=lay.page_axis)


# -- sharded caches, on four CPU devices: each layout with the splits its engine uses --------------

KV_SHARDED = """
    import re
    import jax, jax.numpy as jnp, numpy as np, pytest
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tpusync
    from tpusync.kv.keys import shard_key
    from tpusync.kv.pages import load_pages, save_pages
    shape = (2, 4, 4, 2, 8)

    def round_trip(mesh, spec, shards, blocks_per_key):
        sharding = NamedSharding(mesh, spec)
        k = jax.device_put(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape), sharding)
        v = jax.device_put(-k, sharding)
        with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
            save_pages(store, [7, 8], [k, v], [0, 3], page_axis=1)
            # one block per distinct shard (replicas share it), keyed by the shard's place
            assert store.stats()["blocks"] == 2 * blocks_per_key, store.stats()
            assert store.lookup([shard_key(7, n, shards) for n in range(shards)]).prefix_len == shards
            zeros = jax.device_put(jnp.zeros(shape), sharding)
            (k2, v2), n = load_pages(store, [7, 8], [zeros, jax.device_put(jnp.zeros(shape), sharding)], [1, 2],
                                     page_axis=1)
        assert n == 2 and k2.sharding == sharding
        assert np.array_equal(np.asarray(k2[:, 1]), np.asarray(k[:, 0]))
        assert np.array_equal(np.asarray(v2[:, 2]), np.asarray(v[:, 3]))
        assert not np.asarray(k2[:, 0]).any()

    devs = np.array(jax.devices())
    round_trip(Mesh(devs[:2], ("x",)), P(None, None, None, "x", None), 2, 2)         # kv_heads split
    round_trip(Mesh(devs[::-1][:2], ("x",)), P(None, None, None, "x", None), 2, 2)   # other device order
    round_trip(Mesh(devs.reshape(2, 2), ("r", "x")), P(None, None, None, "x", None), 2, 2)  # replicated x2
    round_trip(Mesh(devs.reshape(2, 2), ("l", "x")), P("l", None, None, "x", None), 4, 4)   # layers and heads
    round_trip(Mesh(devs[:2], ("r",)), P(), 1, 1)                                    # fully replicated
    # A shard's block of the wrong length ends the loaded prefix (a miss, not an error).
    sharding = NamedSharding(Mesh(devs[:2], ("x",)), P(None, None, None, "x", None))
    k = jax.device_put(jnp.ones(shape), sharding)
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        store.put([shard_key(8, 1, 2)], [np.ones(100, np.uint8)])
        save_pages(store, [7, 8, 9], [k, k], [0, 1, 2], page_axis=1)
        zeros = jax.device_put(jnp.zeros(shape), sharding)
        (k2, _), n = load_pages(store, [7, 8, 9], [zeros, jax.device_put(jnp.zeros(shape), sharding)], [0, 1, 2],
                                page_axis=1)
    assert n == 1 and np.asarray(k2[:, 0]).all() and not np.asarray(k2[:, 1:]).any()
    bad = jax.device_put(jnp.zeros(shape), NamedSharding(Mesh(devs[:2], ("p",)), P(None, "p")))
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        with pytest.raises(tpusync.InvalidArgumentError, match=re.escape("pages axis (axis 1) is sharded")):
            save_pages(store, [7], [bad, bad], [0], page_axis=1)
    print("ok")
    """


LAYERS_SHARDED = """
    import re
    import jax, jax.numpy as jnp, numpy as np, pytest
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tpusync
    from tpusync.kv.keys import shard_key
    from tpusync.kv.pages import load_pages, save_pages
    shape = (4, 4, 4, 1, 8)  # pages, page_size, heads x2 (sharded on "model", as tpu-inference does), packing, dim
    devs = np.array(jax.devices())
    sharding = NamedSharding(Mesh(devs[:2], ("model",)), P(None, None, "model", None, None))
    src = [jax.device_put(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * (i + 1), sharding)
           for i in range(2)]
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        save_pages(store, [7, 8], src, [0, 3])
        assert store.stats()["blocks"] == 4, store.stats()  # one block per shard
        assert store.lookup([shard_key(7, n, 2) for n in range(2)]).prefix_len == 2
        zeros = [jax.device_put(jnp.zeros(shape), sharding) for _ in range(2)]
        dst, n = load_pages(store, [7, 8], zeros, [1, 2])
    assert n == 2 and all(d.sharding == sharding for d in dst)
    for a, b in zip(src, dst):
        assert np.array_equal(np.asarray(b[1]), np.asarray(a[0])) and np.array_equal(np.asarray(b[2]), np.asarray(a[3]))
        assert not np.asarray(b[0]).any()
    bad = [jax.device_put(jnp.zeros(shape), NamedSharding(Mesh(devs[:2], ("p",)), P("p")))]
    with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
        with pytest.raises(tpusync.InvalidArgumentError, match=re.escape("pages axis (axis 0) is sharded")):
            save_pages(store, [7], bad, [0])
    print("ok")
    """


@pytest.mark.parametrize("script", ["KV_SHARDED", "LAYERS_SHARDED"])
def test_a_sharded_cache_moves_shard_by_shard(script):
    """k-v split on kv heads, layers and heads, replicated; layers split on tpu-inference's `model` axis."""
    run_on_four_devices(globals()[script])


KV_RESHARDED = """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tpusync
    from tpusync.kv.keys import shard_key
    from tpusync.kv.pages import load_pages_resharded, save_pages
    shape = (2, 4, 4, 4, 8)  # 4 kv heads
    devs = np.array(jax.devices())

    def cache(n, fill=None):
        sharding = NamedSharding(Mesh(devs[:n], ("x",)), P(None, None, None, "x", None))
        data = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) if fill is None else jnp.full(shape, fill)
        return jax.device_put(data, sharding), jax.device_put(-data, sharding)

    for src, dst in ((2, 4), (4, 2), (2, 1), (1, 4), (4, 4)):
        k, v = cache(src)
        with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
            save_pages(store, [7, 8], [k, v], [0, 3], page_axis=1)
            k2, v2 = cache(dst, 0.0)
            (k2, v2), n = load_pages_resharded(store, [7, 8], [k2, v2], [1, 2], src, 3, page_axis=1)
            assert n == 2 and len(k2.sharding.device_set) == dst, (src, dst)
            assert np.array_equal(np.asarray(k2[:, 1]), np.asarray(k[:, 0])), (src, dst)
            assert np.array_equal(np.asarray(v2[:, 2]), np.asarray(v[:, 3])), (src, dst)
            assert not np.asarray(k2[:, 0]).any() and not np.asarray(k2[:, 3]).any()
            # A missing part of the second block (source shard 1 of 2 holds heads 2..3): one page.
            if src == 2:
                store.evict([shard_key(8, 1, 2)])
                (k3, v3), n = load_pages_resharded(store, [7, 8], [*cache(dst, 5.0)], [1, 2], src, 3, page_axis=1)
                assert n == 1 and np.array_equal(np.asarray(k3[:, 1]), np.asarray(k[:, 0])), (src, dst, n)
                assert (np.asarray(k3[:, 2]) == 5.0).all()  # not loaded in part
    print("ok")
    """


LAYERS_RESHARDED = """
    import itertools, re
    import jax, jax.numpy as jnp, numpy as np, pytest
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tpusync
    from tpusync.kv.keys import shard_key
    from tpusync.kv.pages import load_pages_resharded, save_pages
    shape = (5, 4, 8, 1, 16)  # pages, page_size, heads x2 (split on "model"), packing, dim
    devs = np.array(jax.devices())

    def split(n):
        return NamedSharding(Mesh(devs[:n], ("model",)), P(None, None, "model", None, None))

    src = [jnp.asarray(np.random.default_rng(i).normal(size=shape).astype(np.float32)) for i in range(3)]
    for stored, loading in itertools.product((1, 2, 4), (1, 2, 4)):
        with tpusync.KVStore.local(dram_bytes=256 * 8192, block_bytes=8192) as store:
            save_pages(store, [7, 8, 9], [jax.device_put(a, split(stored)) for a in src], [0, 3, 4])
            store.evict([shard_key(9, stored - 1, stored)])  # the last block lacks one part
            zeros = [jax.device_put(jnp.zeros(shape), split(loading)) for _ in src]
            dst, n = load_pages_resharded(store, [7, 8, 9], zeros, [1, 2, 4], stored, 2)
        assert n == 2, (stored, loading, n)
        assert all(d.sharding == split(loading) for d in dst)
        for a, b in zip(src, dst):
            assert np.array_equal(np.asarray(b[1]), np.asarray(a[0])), (stored, loading)
            assert np.array_equal(np.asarray(b[2]), np.asarray(a[3])), (stored, loading)
            assert not np.asarray(b[0]).any() and not np.asarray(b[4]).any()
    with tpusync.KVStore.local(dram_bytes=256 * 8192, block_bytes=8192) as store:
        save_pages(store, [7], [jax.device_put(a, split(4)) for a in src], [0])
        dst, n = load_pages_resharded(store, [7], [jnp.zeros(shape) for _ in src], [0], 2, 2)
        assert n == 0  # stored in 4 parts, asked for 2: other keys, nothing taken for what it is not
        with pytest.raises(tpusync.InvalidArgumentError, match=re.escape("cannot be split in 3")):
            load_pages_resharded(store, [7], [jnp.zeros(shape) for _ in src], [0], 3, 2)
    print("ok")
    """


@pytest.mark.parametrize("script", ["KV_RESHARDED", "LAYERS_RESHARDED"])
def test_a_cache_split_otherwise_loads_what_each_shard_overlaps(script):
    """Tensor parallelism of another degree (2 -> 4, 4 -> 2, 2 -> 1, 1 -> 4, ...): blocks stored in
    parts along the heads axis load bit-exact, each shard reading only the parts it overlaps; a
    block missing a part ends the run, and parts of another split are never taken for the asked one."""
    run_on_four_devices(globals()[script])


KV_REGROUPED = """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tpusync
    from tpusync.kv.pages import load_pages_resharded, save_pages
    devs = np.array(jax.devices())

    def cache(n, page, fill=None):
        shape = (2, 32 // page, page, 4, 8)  # 32 tokens in pages of `page`, 4 kv heads
        sharding = NamedSharding(Mesh(devs[:n], ("x",)), P(None, None, None, "x", None))
        data = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) if fill is None else jnp.full(shape, fill)
        return jax.device_put(data, sharding), jax.device_put(-data, sharding)

    def tokens(a):  # [layers, positions, heads, dim]
        a = np.asarray(a)
        return a.reshape(a.shape[0], -1, *a.shape[3:])

    for (src, src_page), (dst, page) in (((2, 4), (4, 8)), ((4, 8), (2, 4)), ((1, 8), (2, 2))):
        k, v = cache(src, src_page)
        keys = list(range(100, 100 + 32 // src_page))
        with tpusync.KVStore.local(dram_bytes=64 * 4096, block_bytes=4096) as store:
            save_pages(store, keys, [k, v], list(range(len(keys))), page_axis=1)
            (k2, v2), n = load_pages_resharded(store, keys, [*cache(dst, page, 0.0)], list(range(32 // page)), src,
                                               3, page_axis=1, src_page_tokens=src_page)
            assert n == 32 // page, (src, dst, n)
            assert np.array_equal(tokens(k2), tokens(k)) and np.array_equal(tokens(v2), tokens(v)), (src, dst)
            # Pages from inside a block: the run starts at token 2 of the first block.
            if src_page > page:
                (k3, _), n = load_pages_resharded(store, keys, [*cache(dst, page, 0.0)], [0], src, 3, page_axis=1,
                                                  src_page_tokens=src_page, first_token=page)
                assert n == 1 and np.array_equal(tokens(k3)[:, :page], tokens(k)[:, page:2 * page])
    print("ok")
    """


LAYERS_REGROUPED = """
    import itertools
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import tpusync
    from tpusync.kv.keys import shard_key
    from tpusync.kv.pages import load_pages_resharded, save_pages
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
            save_pages(store, keys, cache(stored_page, stored), list(range(TOKENS // stored_page)))
            store.evict([shard_key(keys[-1], stored - 1, stored)])  # the last block lacks a part
            zeros = [jax.device_put(jnp.zeros((PAGES, page, HEADS, 1, DIM)), split(loading)) for _ in stream]
            dst, n = load_pages_resharded(store, keys[first:], zeros, pids, stored, 2,
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


@pytest.mark.parametrize("script", ["KV_REGROUPED", "LAYERS_REGROUPED"])
def test_blocks_of_another_page_size_load_the_tokens_each_page_overlaps(script):
    """Page size and split both other than the storing engine's: blocks of 4 or 8 tokens load
    bit-exact into pages of 2 to 16 tokens, from the middle of a stored block, and a block
    missing a part ends the run before the first page that needs it."""
    run_on_four_devices(globals()[script])


def test_page_ranges_cover_the_page_once():
    assert page_ranges(32, 16, 0, 0) == [(0, 0, 0, 16), (1, 0, 16, 16)]
    assert page_ranges(32, 16, 0, 1) == [(2, 0, 0, 16), (3, 0, 16, 16)]
    assert page_ranges(16, 32, 16, 0) == [(0, 16, 0, 16)]
    assert page_ranges(16, 32, 16, 1) == [(1, 0, 0, 16)]
    assert page_ranges(16, 16, 0, 2) == [(2, 0, 0, 16)]


def test_reshard_ranges_cover_the_target_once():
    assert reshard_ranges(8, 2, (0, 4)) == [(0, 0, 0, 4)]
    assert reshard_ranges(8, 4, (0, 4)) == [(0, 0, 0, 2), (1, 0, 2, 2)]
    assert reshard_ranges(8, 1, (4, 6)) == [(0, 4, 0, 2)]
    assert reshard_ranges(8, 4, (3, 7)) == [(1, 1, 0, 1), (2, 0, 1, 2), (3, 0, 3, 1)]


def test_shard_numbers_come_from_the_shard_position_not_the_local_order():
    """A host holding only shards 2 and 3 of 4 must key them 2 and 3, as the host that saved them did."""
    shape, shard_shape = (4, 8, 4, 8, 16), (2, 8, 4, 4, 16)   # layers split in 2, kv_heads in 2
    full = slice(None)
    def index(layer, head):
        return (slice(2 * layer, 2 * layer + 2), full, full, slice(4 * head, 4 * head + 4), full)
    numbers = [shard_number(index(layer, head), shape, shard_shape) for layer in (0, 1) for head in (0, 1)]
    assert numbers == [0, 1, 2, 3]
    assert shard_number(index(1, 0), shape, shard_shape) == 2
    assert shard_number((full,) * 5, shape, shape) == 0
