"""Copy pages of a paged KV cache between jax.Arrays and store blocks.

Cache layout: `k`, `v`: [layers, pages, page_size, kv_heads, head_dim], any dtype (bfloat16
included). One block holds one page of every layer, K then V: [2, layers, page_size,
kv_heads, head_dim]. On the CPU backend a jax.Array is host memory, so pages are copied
straight between the array's buffer and the pool slot, with no staging copy; other
backends gather the pages on the device and transfer just those. Loads go through one host
staging copy per group of pages (then one host-to-device copy). A sharded cache is moved
shard by shard from the shards this host holds; each shard's block has its own key.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from tpusync import errors
from tpusync.store import KVStore

_GROUP = 16  # pages per device update call (padded by repeating the last page)


def shard_key(key: int, shard: int, shards: int) -> int:
    """The key of one shard's part of a block (the block key itself when unsharded). The split
    is part of the key: shard 0 of 2 and shard 0 of 4 hold other heads, so an engine of
    another tensor parallelism never takes one for the other. Its own inverse."""
    if shards == 1:
        return key
    return (key ^ (0x9E3779B97F4A7C15_2545F4914F6CDD1D * ((shards << 32) | (shard + 1)))) & ((1 << 128) - 1)


def _check_fits(store: KVStore, page_bytes: int) -> None:
    if page_bytes > store.block_bytes:
        raise errors.InvalidArgumentError(f"a page of this cache is {page_bytes} bytes, the store's blocks hold "
                                          f"{store.block_bytes}")


def shard_number(index: tuple[slice, ...], shape: Sequence[int], shard_shape: Sequence[int]) -> int:
    """A shard's global number, from its position in the array: the same on every host
    (replicas of one shard share it)."""
    n = 0
    for idx, dim, size in zip(index, shape, shard_shape):
        n = n * (dim // size) + (idx.start or 0) // size
    return n


def _is_sharded(arr: jax.Array) -> bool:
    """Spread over several devices, here or on other hosts (loads go shard by shard)."""
    return len(arr.addressable_shards) > 1 or not arr.is_fully_addressable


def _numbered_shards(arr: jax.Array) -> tuple[int, list[tuple[int, jax.Shard]]]:
    """(shards in the global array, [(global shard number, shard)] for this host's devices)."""
    shard_shape = arr.sharding.shard_shape(arr.shape)
    if shard_shape[1] != arr.shape[1]:
        raise errors.InvalidArgumentError(
            f"the cache's pages axis (axis 1) is sharded ({arr.shape[1]} pages, {shard_shape[1]} per shard): "
            "page ids are global, so shard layers, page slots or kv_heads instead")
    total = int(np.prod([dim // size for dim, size in zip(arr.shape, shard_shape)]))
    return total, [(shard_number(s.index, arr.shape, shard_shape), s) for s in arr.addressable_shards]


def _local_shards(arr: jax.Array) -> tuple[int, dict[int, jax.Array]]:
    """(shards in the global array, {global shard number: data} for this host's distinct shards)."""
    total, numbered = _numbered_shards(arr)
    shards: dict[int, jax.Array] = {}
    for n, s in numbered:
        shards.setdefault(n, s.data)
    return total, dict(sorted(shards.items()))


def _host_pages(data: jax.Array, page_ids: Sequence[int]) -> tuple[np.ndarray, list[int]]:
    """A host view holding the wanted pages, and their index in it."""
    if next(iter(data.devices())).platform == "cpu":  # never pop: jax may hand out its own set
        data.block_until_ready()
        return np.asarray(data), list(page_ids)  # the device buffer itself
    gathered = jnp.take(data, jnp.asarray(page_ids), axis=1)
    return np.asarray(gathered), list(range(len(page_ids)))  # one device-to-host transfer of just these pages


def host_shards(k: jax.Array) -> tuple[int, list[int]]:
    """(shards of a K/V cache, the global numbers of those held on this host)."""
    total, shards = _local_shards(k)
    return total, list(shards)


def save_pages(store: KVStore, keys: Sequence[int], k: jax.Array, v: jax.Array, page_ids: Sequence[int]) -> int:
    """Stores the given pages under `keys` (blocks already stored are skipped). Returns bytes written."""
    if len(keys) != len(page_ids):
        raise ValueError(f"{len(keys)} keys for {len(page_ids)} pages")
    written = 0
    total, k_shards = _local_shards(k)
    _, v_shards = _local_shards(v)
    for n, ks in k_shards.items():
        vs = v_shards[n]
        kh, idx = _host_pages(ks, page_ids)
        vh, _ = _host_pages(vs, page_ids)
        shard_keys = [shard_key(key, n, total) for key in keys]
        block_shape = (2,) + kh.shape[:1] + kh.shape[2:]
        nbytes = int(np.prod(block_shape)) * kh.dtype.itemsize
        _check_fits(store, nbytes)
        for g in range(0, len(shard_keys), _GROUP):  # reserved slots cannot be evicted: keep groups small
            with store.reserve_many(shard_keys[g:g + _GROUP]) as slots:
                for slot, i in zip(slots, idx[g:g + _GROUP]):
                    if slot is None:
                        continue  # already stored (content-addressed)
                    block = np.frombuffer(slot.view, dtype=kh.dtype, count=int(np.prod(block_shape)))
                    block = block.reshape(block_shape)
                    np.copyto(block[0], kh[:, i])
                    np.copyto(block[1], vh[:, i])
                    del block
                    slot.commit(nbytes)
                    written += nbytes
    return written


@partial(jax.jit, donate_argnums=(0, 1))
def _set_pages(k: jax.Array, v: jax.Array, blocks: np.ndarray, page_ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """blocks: [_GROUP, 2, layers, page_size, kv_heads, head_dim]; page_ids: [_GROUP] int32."""
    for i in range(_GROUP):
        k = jax.lax.dynamic_update_slice_in_dim(k, blocks[i, 0][:, None], page_ids[i], axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(v, blocks[i, 1][:, None], page_ids[i], axis=1)
    return k, v


def load_pages(store: KVStore, keys: Sequence[int], k: jax.Array, v: jax.Array,
               page_ids: Sequence[int]) -> tuple[jax.Array, jax.Array, int]:
    """Loads stored blocks into the given pages. Returns the updated (k, v) and the number of
    leading pages loaded; loading stops at the first block the store lacks, or holds with
    another length than a page's (not a page of this cache: a miss, never loaded in part)."""
    if _is_sharded(k):
        return _load_pages_sharded(store, keys, k, v, page_ids)
    loaded = 0
    shape = (2,) + k.shape[:1] + k.shape[2:]
    count = int(np.prod(shape))
    nbytes = count * k.dtype.itemsize
    _check_fits(store, nbytes)
    for g in range(0, len(keys), _GROUP):
        group_keys, group_pages = list(keys[g:g + _GROUP]), list(page_ids[g:g + _GROUP])
        with store.acquire_many(group_keys) as views:
            present = next((i for i, view in enumerate(views) if view is None or len(view) != nbytes), len(views))
            if present == 0:
                break
            # One staging copy: a jax.Array aliasing a slot could outlive the slot's lease.
            staging = np.empty((_GROUP,) + shape, k.dtype)
            for i in range(present):
                view = cast(memoryview, views[i])  # i < present: not None
                np.copyto(staging[i], np.frombuffer(view, dtype=k.dtype, count=count).reshape(shape))
        staging[present:] = staging[present - 1]  # pad: rewriting the last page is harmless
        pids = group_pages[:present] + [group_pages[present - 1]] * (_GROUP - present)
        k, v = _set_pages(k, v, staging, np.asarray(pids, np.int32))
        loaded += present
        if present < len(group_keys):
            break
    return k, v, loaded


def _load_pages_sharded(store: KVStore, keys: Sequence[int], k: jax.Array, v: jax.Array,
                        page_ids: Sequence[int]) -> tuple[jax.Array, jax.Array, int]:
    """Each host loads its own shards: builds per-shard page arrays and reassembles the global
    array. Loads the prefix every local shard has (a block evicted meanwhile, or of another
    length than a shard's page, shortens it)."""
    total, k_shards = _local_shards(k)
    _, v_shards = _local_shards(v)
    loaded = min(store.lookup([shard_key(key, n, total) for key in keys]).prefix_len for n in k_shards)
    if loaded == 0:
        return k, v, 0
    host: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    copied: dict[int, int] = {}
    for n, ks in k_shards.items():
        kh, vh = np.array(ks), np.array(v_shards[n])
        shape = (2,) + kh.shape[:1] + kh.shape[2:]
        count = int(np.prod(shape))
        with store.acquire_many([shard_key(key, n, total) for key in keys[:loaded]]) as views:
            for i, (view, pid) in enumerate(zip(views, page_ids[:loaded])):
                if view is None or len(view) != count * kh.dtype.itemsize:
                    loaded = i
                    break
                block = np.frombuffer(view, dtype=kh.dtype, count=count).reshape(shape)
                kh[:, pid], vh[:, pid] = block[0], block[1]
        host[n], copied[n] = (kh, vh), loaded
    if loaded == 0:
        return k, v, 0
    for n, (kh, vh) in host.items():  # a later shard ended the prefix sooner: put back the pages past it
        for pid in page_ids[loaded:copied[n]]:
            kh[:, pid], vh[:, pid] = np.asarray(k_shards[n][:, pid]), np.asarray(v_shards[n][:, pid])
    _, numbered = _numbered_shards(k)
    new_k = [jax.device_put(host[n][0], s.device) for n, s in numbered]
    new_v = [jax.device_put(host[n][1], s.device) for n, s in numbered]
    k = jax.make_array_from_single_device_arrays(k.shape, k.sharding, new_k)
    v = jax.make_array_from_single_device_arrays(v.shape, v.sharding, new_v)
    return k, v, loaded


def compile_loads(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Compiles the page-load update for this cache (rewrites page 0 with its own content)."""
    if _is_sharded(k):
        return k, v
    block = np.asarray(jnp.stack([k[:, 0], v[:, 0]]))
    compiled: tuple[jax.Array, jax.Array] = _set_pages(k, v, np.stack([block] * _GROUP), np.zeros(_GROUP, np.int32))
    return compiled


# -- list-of-layers caches: one jax.Array per layer, the page axis first ------------------------
#
# tpu-inference's layout: `[pages, page_size, ...]` per layer (the rest is the attention
# kernel's packing of K and V, copied as bytes). One block holds one page of every layer, layer
# after layer. A layer sharded on another axis (tpu-inference shards on `model`) is moved shard
# by shard, each shard's block under its own key (`shard_key`), as for the K/V layout above.


def _layer_shards(layers: Sequence[jax.Array]) -> tuple[int, dict[int, list[jax.Array]]]:
    """(shards per layer, {global shard number: that shard of every layer}) for this host."""
    total: int | None = None
    numbered: dict[int, list[jax.Array]] = {}
    for layer in layers:
        shard_shape = layer.sharding.shard_shape(layer.shape)
        if shard_shape[0] != layer.shape[0]:
            raise errors.InvalidArgumentError(
                f"a layer's pages axis (axis 0) is sharded ({layer.shape[0]} pages, {shard_shape[0]} per shard): "
                "page ids are global")
        n_total = int(np.prod([dim // size for dim, size in zip(layer.shape, shard_shape)]))
        if total not in (None, n_total):
            raise errors.InvalidArgumentError("layers are sharded differently")
        total = n_total
        seen: set[int] = set()
        for s in layer.addressable_shards:
            n = shard_number(s.index, layer.shape, shard_shape)
            if n not in seen:
                seen.add(n)
                numbered.setdefault(n, []).append(s.data)
    return total or 1, dict(sorted(numbered.items()))


def layer_shard_count(layers: Sequence[jax.Array]) -> int:
    """How many shards each layer of a list-of-layers cache is split in (1: unsharded); each
    shard's part of a block is stored under its own key (`shard_key`)."""
    return _layer_shards(layers)[0]


def layer_host_shards(layers: Sequence[jax.Array]) -> list[int]:
    """The global numbers of the shards of a list-of-layers cache that this host holds."""
    return list(_layer_shards(layers)[1])


def source_parts(layers: Sequence[jax.Array], src_shards: int, axis: int) -> list[int]:
    """The parts of a block stored split in `src_shards` along `axis` that this host's shards
    overlap (what load_layer_pages_resharded reads here)."""
    ranges = _axis_ranges(layers[0], axis)
    return sorted({m for r in ranges.values() for m, *_ in reshard_ranges(layers[0].shape[axis], src_shards, r)})


def _gather_pages(data: jax.Array, page_ids: Sequence[int]) -> tuple[np.ndarray, list[int]]:
    """A host view holding the wanted pages of one layer (axis 0), and their index in it."""
    if next(iter(data.devices())).platform == "cpu":  # never pop: jax may hand out its own set
        data.block_until_ready()
        return np.asarray(data), list(page_ids)  # the buffer itself
    return np.asarray(jnp.take(data, jnp.asarray(page_ids), axis=0)), list(range(len(page_ids)))


def layer_shard_keys(keys: Sequence[int], layers: Sequence[jax.Array]) -> list[int]:
    """The pool keys save_layer_pages stores these blocks under on this host: one per shard of
    each block held here (the block keys themselves when unsharded)."""
    total, shards = _layer_shards(layers)
    return [shard_key(k, n, total) for k in keys for n in shards]


def layer_block_bytes(layers: Sequence[jax.Array]) -> int:
    """Bytes of one block of a list-of-layers cache (one page of every layer, one shard)."""
    total = 0
    for layer in layers:
        shard = layer.sharding.shard_shape(layer.shape)
        total += int(np.prod(shard[1:])) * layer.dtype.itemsize
    return total


def save_layer_pages(store: KVStore, keys: Sequence[int], layers: Sequence[jax.Array],
                     page_ids: Sequence[int]) -> int:
    """Stores pages of a list-of-layers cache under `keys` (blocks already stored are
    skipped). Returns bytes written."""
    if len(keys) != len(page_ids):
        raise ValueError(f"{len(keys)} keys for {len(page_ids)} pages")
    total, shards = _layer_shards(layers)
    written = 0
    for n, parts in shards.items():
        host = [_gather_pages(p, page_ids) for p in parts]
        sizes = [int(np.prod(h.shape[1:])) * h.dtype.itemsize for h, _ in host]
        nbytes = sum(sizes)
        _check_fits(store, nbytes)
        shard_keys = [shard_key(key, n, total) for key in keys]
        for g in range(0, len(shard_keys), _GROUP):  # reserved slots cannot be evicted: keep groups small
            with store.reserve_many(shard_keys[g:g + _GROUP]) as slots:
                for j, slot in enumerate(slots):
                    if slot is None:
                        continue  # already stored (content-addressed)
                    dst = np.frombuffer(slot.view, dtype=np.uint8, count=nbytes)
                    offset = 0
                    for (h, idx), size in zip(host, sizes):
                        dst[offset:offset + size] = h[idx[g + j]].reshape(-1).view(np.uint8)
                        offset += size
                    del dst
                    slot.commit(nbytes)
                    written += nbytes
    return written


@partial(jax.jit, donate_argnums=(0,))
def _set_layer_pages(layers: list[jax.Array], blocks: list[np.ndarray], page_ids: np.ndarray) -> list[jax.Array]:
    """layers: [pages, ...] each; blocks: one [_GROUP, ...] array per layer; page_ids: [_GROUP]."""
    return [layer.at[page_ids].set(block) for layer, block in zip(layers, blocks)]


def _stage_layer_blocks(store: KVStore, keys: list[int], staging: list[np.ndarray], sizes: list[int]) -> int:
    """Copies the leading stored blocks of `keys` into the staging arrays (one per layer);
    returns how many (the first absent block, or one of another size, ends them)."""
    nbytes = sum(sizes)
    with store.acquire_many(keys) as views:
        present = next((i for i, view in enumerate(views) if view is None or len(view) != nbytes), len(views))
        # One staging copy: a jax.Array aliasing a slot could outlive the slot's lease.
        for i in range(present):
            src = np.frombuffer(cast(memoryview, views[i]), dtype=np.uint8, count=nbytes)  # i < present
            offset = 0
            for st, size in zip(staging, sizes):
                st[i].reshape(-1).view(np.uint8)[:] = src[offset:offset + size]
                offset += size
            del src
    return present


def load_layer_pages(store: KVStore, keys: Sequence[int], layers: Sequence[jax.Array],
                     page_ids: Sequence[int]) -> tuple[list[jax.Array], int]:
    """Loads stored blocks into pages of a list-of-layers cache: one jitted update of every
    layer per group of pages, the old layers donated. Returns the new layers and the number of
    leading pages loaded; loading stops at the first block the store lacks (or of another size),
    or at a store error once a group is loaded (the layers passed in are gone by then; an error
    before that raises)."""
    layers = list(layers)
    if any(_is_sharded(layer) for layer in layers):
        return _load_layer_pages_sharded(store, keys, layers, page_ids)
    shapes = [layer.shape[1:] for layer in layers]
    sizes = [int(np.prod(s)) * layer.dtype.itemsize for s, layer in zip(shapes, layers)]
    nbytes = sum(sizes)
    _check_fits(store, nbytes)
    loaded = 0
    for g in range(0, len(keys), _GROUP):
        group_keys, group_pages = list(keys[g:g + _GROUP]), list(page_ids[g:g + _GROUP])
        staging = [np.empty((_GROUP,) + tuple(s), layer.dtype) for s, layer in zip(shapes, layers)]
        try:
            present = _stage_layer_blocks(store, group_keys, staging, sizes)
        except (errors.TpuSyncError, OSError):
            if loaded:  # the caller's layers were donated to earlier groups' updates: hand back the new ones
                break
            raise
        if present == 0:
            break
        for st in staging:
            st[present:] = st[present - 1]  # pad: rewriting the last page is harmless
        pids = group_pages[:present] + [group_pages[present - 1]] * (_GROUP - present)
        layers = _set_layer_pages(layers, staging, np.asarray(pids, np.int32))
        loaded += present
        if present < len(group_keys):
            break
    return list(layers), loaded


def _load_layer_pages_sharded(store: KVStore, keys: Sequence[int], layers: list[jax.Array],
                              page_ids: Sequence[int]) -> tuple[list[jax.Array], int]:
    """Each host loads its own shards of every layer and reassembles the global arrays."""
    total, shards = _layer_shards(layers)
    loaded = min(store.lookup([shard_key(key, n, total) for key in keys]).prefix_len for n in shards)
    if loaded == 0:
        return layers, 0
    host: dict[int, list[np.ndarray]] = {}
    for n, parts in shards.items():
        arrays = [np.array(p) for p in parts]
        sizes = [int(np.prod(a.shape[1:])) * a.dtype.itemsize for a in arrays]
        with store.acquire_many([shard_key(key, n, total) for key in keys[:loaded]]) as views:
            for i, (view, pid) in enumerate(zip(views, page_ids[:loaded])):
                if view is None or len(view) != sum(sizes):
                    loaded = i
                    break
                src = np.frombuffer(view, dtype=np.uint8, count=sum(sizes))
                offset = 0
                for a, size in zip(arrays, sizes):
                    a[pid].reshape(-1).view(np.uint8)[:] = src[offset:offset + size]
                    offset += size
                del src
        host[n] = arrays
    return (_assemble(layers, host), loaded) if loaded else (layers, 0)


def _assemble(layers: list[jax.Array], host: dict[int, list[np.ndarray]]) -> list[jax.Array]:
    """The global arrays again, each device given its shard's host copy."""
    out: list[jax.Array] = []
    for li, layer in enumerate(layers):
        shard_shape = layer.sharding.shard_shape(layer.shape)
        parts = [jax.device_put(host[shard_number(s.index, layer.shape, shard_shape)][li], s.device)
                 for s in layer.addressable_shards]
        out.append(jax.make_array_from_single_device_arrays(layer.shape, layer.sharding, parts))
    return out


# -- loads of blocks stored by an engine whose cache is split or paged otherwise -----------------


def _pieces(width: int, start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """Positions [start, stop) of a run cut in parts of `width`: [(part, first position in it,
    first position in [start, stop), count)]."""
    out = []
    for i in range(start // width, -(-stop // width)):
        lo, hi = max(start, i * width), min(stop, (i + 1) * width)
        out.append((i, lo - i * width, lo - start, hi - lo))
    return out


def reshard_ranges(length: int, src_shards: int, dst: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """The stored parts that make up positions [dst[0], dst[1]) of an axis of `length` split in
    `src_shards` equal parts: [(source shard, first position in it, first position in dst, count)]."""
    if length % src_shards:
        raise errors.InvalidArgumentError(f"an axis of {length} cannot be split in {src_shards} equal parts")
    return _pieces(length // src_shards, dst[0], dst[1])


def page_ranges(page_tokens: int, src_page_tokens: int, first_token: int, page: int) -> list[tuple[int, int, int, int]]:
    """The stored blocks (of `src_page_tokens` tokens each, the first of them starting
    `first_token` tokens before this run) that make up page `page` here (of `page_tokens`):
    [(block, first token in it, first token in the page, count)]."""
    start = first_token + page * page_tokens
    return _pieces(src_page_tokens, start, start + page_tokens)


def head_sources(k: jax.Array, src_shards: int) -> dict[int, list[tuple[int, int, int, int]]]:
    """For each of this host's shards of a K/V cache split on kv heads (axis 3): the parts of a
    block stored split in `src_shards` along kv heads that it overlaps (`reshard_ranges`)."""
    return {n: reshard_ranges(k.shape[3], src_shards, heads) for n, heads in _axis_ranges(k, 3).items()}


def load_pages_resharded(store: KVStore, keys: Sequence[int], k: jax.Array, v: jax.Array, page_ids: Sequence[int],
                         src_shards: int, *, src_page_tokens: int = 0,
                         first_token: int = 0) -> tuple[jax.Array, jax.Array, int]:
    """Loads blocks that an engine with this cache's layers stored split in `src_shards` equal
    parts along kv heads (`save_pages` of a cache sharded there) into this cache however it is
    split along them (tensor parallelism of another degree): each shard here reads only the
    stored parts it overlaps, no host gathers a whole block.

    `src_page_tokens`: the tokens of a stored block where that engine's pages held another number
    than this cache's (0: as here); the blocks of `keys` then hold consecutive tokens from token
    `first_token` of keys[0], and each page here takes the token ranges of the blocks it overlaps
    (`page_ranges`). Returns the updated (k, v) and the number of leading pages loaded: a page
    loads only when every part this host needs of every block it overlaps is stored, with a
    part's length."""
    plans = head_sources(k, src_shards)
    layers, _, page_tokens, heads, head_dim = k.shape
    src_page = src_page_tokens or page_tokens
    part = (2, layers, src_page, heads // src_shards, head_dim)
    count = int(np.prod(part))
    _check_fits(store, count * k.dtype.itemsize)
    tokens = [page_ranges(page_tokens, src_page, first_token, j) for j in range(len(page_ids))]

    def pages_within(blocks: int) -> int:  # leading pages whose blocks are all among the first `blocks`
        return next((j for j, t in enumerate(tokens) if t[-1][0] >= blocks), len(tokens))

    def parts(plan: list[tuple[int, int, int, int]], blocks: Sequence[int]) -> list[int]:
        return [shard_key(key, m, src_shards) for key in blocks for m, *_ in plan]

    loaded = min(pages_within(store.lookup(parts(plan, keys)).prefix_len // len(plan)) for plan in plans.values())
    _, shards = _layer_shards([k, v])
    host: dict[int, list[np.ndarray]] = {}
    copied: dict[int, int] = {}
    for n, (ks, vs) in shards.items():
        if loaded == 0:
            return k, v, 0
        plan, kh, vh = plans[n], np.array(ks), np.array(vs)
        blocks = tokens[loaded - 1][-1][0] + 1
        with store.acquire_many(parts(plan, keys[:blocks])) as views:
            whole = next((b for b in range(blocks) if any(
                view is None or len(view) != count * k.dtype.itemsize
                for view in views[b * len(plan):(b + 1) * len(plan)])), blocks)
            loaded = min(loaded, pages_within(whole))  # evicted since the lookup, or not this model's pages
            for j, pid in enumerate(page_ids[:loaded]):
                for b, t_src, t_dst, t_count in tokens[j]:
                    for p, (_, h_src, h_dst, width) in enumerate(plan):
                        block = np.frombuffer(cast(memoryview, views[b * len(plan) + p]), dtype=kh.dtype,
                                              count=count).reshape(part)
                        src = (slice(None), slice(t_src, t_src + t_count), slice(h_src, h_src + width))
                        kh[:, pid, t_dst:t_dst + t_count, h_dst:h_dst + width] = block[0][src]
                        vh[:, pid, t_dst:t_dst + t_count, h_dst:h_dst + width] = block[1][src]
                        del block
        host[n], copied[n] = [kh, vh], loaded
    for n, (kh, vh) in host.items():  # a later shard ended the prefix sooner: put back the pages past it
        for pid in page_ids[loaded:copied[n]]:
            kh[:, pid], vh[:, pid] = np.asarray(shards[n][0][:, pid]), np.asarray(shards[n][1][:, pid])
    if loaded == 0:
        return k, v, 0
    k, v = _assemble([k, v], host)
    return k, v, loaded


def _axis_ranges(layer: jax.Array, axis: int) -> dict[int, tuple[int, int]]:
    """{global shard number: [start, stop) along `axis`} of this host's shards of a layer split
    along `axis` only."""
    shard_shape = layer.sharding.shard_shape(layer.shape)
    if any(size != dim for i, (dim, size) in enumerate(zip(layer.shape, shard_shape)) if i != axis):
        raise errors.InvalidArgumentError(f"the cache is split along axes other than {axis}: {shard_shape} of "
                                          f"{layer.shape}")
    return {shard_number(s.index, layer.shape, shard_shape): (s.index[axis].start or 0,
                                                               (s.index[axis].start or 0) + shard_shape[axis])
            for s in layer.addressable_shards}


def load_layer_pages_resharded(store: KVStore, keys: Sequence[int], layers: Sequence[jax.Array],
                               page_ids: Sequence[int], src_shards: int, axis: int, *, src_page_tokens: int = 0,
                               first_token: int = 0) -> tuple[list[jax.Array], int]:
    """Loads blocks that an engine with the same layers (but for their page size) stored split in
    `src_shards` equal parts along `axis` (`save_layer_pages` of a cache sharded there), into
    this cache however it is split along that axis (tensor parallelism of another degree): each
    shard here reads only the stored parts it overlaps.

    `src_page_tokens`: the tokens of a stored block where that engine's pages held another
    number than this cache's (0: as here). The blocks of `keys` then hold consecutive tokens,
    from token `first_token` of keys[0], and each page here takes the token ranges of the
    blocks it overlaps (two blocks of 16 tokens for a page of 32, half a block of 32 for a
    page of 16). Returns the new layers and the number of leading pages loaded: a page is
    loaded only when every part of every block it overlaps is stored (as `load_layer_pages`)."""
    layers = list(layers)
    page_tokens = layers[0].shape[1]
    src_page = src_page_tokens or page_tokens
    if axis == 1 or any(layer.shape[1] != page_tokens for layer in layers):
        raise errors.InvalidArgumentError("the layers' pages must hold one number of tokens, split on another axis")
    ranges = _axis_ranges(layers[0], axis)
    if any(_axis_ranges(layer, axis) != ranges for layer in layers[1:]):
        raise errors.InvalidArgumentError("layers are sharded differently")
    part_shapes = []
    for layer in layers:
        if layer.shape[axis] % src_shards:
            raise errors.InvalidArgumentError(f"axis {axis} of a layer {layer.shape} cannot be split in {src_shards}")
        part_shapes.append(tuple(d // src_shards if i == axis else src_page if i == 1 else d
                                 for i, d in enumerate(layer.shape))[1:])
    sizes = [int(np.prod(shape)) * layer.dtype.itemsize for shape, layer in zip(part_shapes, layers)]
    offsets = np.cumsum([0] + sizes).tolist()
    _check_fits(store, offsets[-1])
    _, shards = _layer_shards(layers)
    heads = {n: reshard_ranges(layers[0].shape[axis], src_shards, ranges[n]) for n in shards}
    tokens = [page_ranges(page_tokens, src_page, first_token, j) for j in range(len(page_ids))]

    def pages_within(blocks: int) -> int:  # leading pages whose blocks are all among the first `blocks`
        return next((j for j, t in enumerate(tokens) if t[-1][0] >= blocks), len(tokens))

    loaded = len(page_ids)
    for plan in heads.values():
        wanted = [shard_key(key, i, src_shards) for key in keys for i, *_ in plan]
        loaded = min(loaded, pages_within(store.lookup(wanted).prefix_len // len(plan)))
    host: dict[int, list[np.ndarray]] = {}
    for n, parts in shards.items():
        if loaded == 0:
            break
        plan, arrays = heads[n], [np.array(p) for p in parts]
        blocks = tokens[loaded - 1][-1][0] + 1
        with store.acquire_many([shard_key(key, i, src_shards) for key in keys[:blocks] for i, *_ in plan]) as views:
            whole = next((b for b in range(blocks) if any(
                view is None or len(view) != offsets[-1] for view in views[b * len(plan):(b + 1) * len(plan)])), blocks)
            loaded = min(loaded, pages_within(whole))
            for j, pid in enumerate(page_ids[:loaded]):
                for b, t_src, t_dst, t_count in tokens[j]:
                    for p, (_, h_src, h_dst, h_count) in enumerate(plan):
                        raw = np.frombuffer(cast(memoryview, views[b * len(plan) + p]), dtype=np.uint8,
                                            count=offsets[-1])
                        for li, a in enumerate(arrays):
                            part = raw[offsets[li]:offsets[li + 1]].view(a.dtype).reshape(part_shapes[li])
                            src: list[slice] = [slice(None)] * part.ndim
                            dst: list[slice] = [slice(None)] * part.ndim
                            src[0], dst[0] = slice(t_src, t_src + t_count), slice(t_dst, t_dst + t_count)
                            src[axis - 1] = slice(h_src, h_src + h_count)
                            dst[axis - 1] = slice(h_dst, h_dst + h_count)
                            a[pid][tuple(dst)] = part[tuple(src)]
                        del raw
        host[n] = arrays
    return (_assemble(layers, host), loaded) if loaded else (layers, 0)
