"""Copy pages of a paged KV cache between jax.Arrays and store blocks.

A cache is a list of layers, each a jax.Array with a pages axis (`page_axis`), and one block
holds one page of every layer, layer after layer, each as the layer's array without that axis.
The two layouts tpusync moves are two cases of it:

- tpu-inference's: one array per layer, `[pages, page_size, ...]` (the rest is the attention
  kernel's packing of K and V, copied as bytes): `page_axis=0`.
- the reference engine's: `[k, v]`, each `[layers, pages, page_size, kv_heads, head_dim]`, so a
  block is `[2, layers, page_size, kv_heads, head_dim]`, K then V: `page_axis=1`.

On the CPU backend a jax.Array is host memory, so pages are copied straight between the
array's buffer and the pool slot, with no staging copy; other backends gather the pages on
the device and transfer just those. Loads go through one host staging copy per group of pages
(then one jitted, donated update of every layer). A cache split over devices along another
axis (tensor parallelism) is moved shard by shard, from the shards this host holds; each
shard's part of a block has its own key (`shard_key`), and blocks stored split otherwise, or
paged otherwise, load regrouped (`load_pages_resharded`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

from tpusync import errors
from tpusync.kv.keys import shard_key
from tpusync.store import KVStore

_GROUP = 16  # pages per device update call (padded by repeating the last page)
# The pages and the kv heads axes of a `[k, v]` cache, each `[layers, pages, page_size, kv_heads, head_dim]`.
KV_PAGE_AXIS, KV_HEAD_AXIS = 1, 3


def shard_number(index: tuple[slice, ...], shape: Sequence[int], shard_shape: Sequence[int]) -> int:
    """A shard's global number, from its position in the array: the same on every host
    (replicas of one shard share it)."""
    n = 0
    for idx, dim, size in zip(index, shape, shard_shape):
        n = n * (dim // size) + (idx.start or 0) // size
    return n


def _check_fits(store: KVStore, page_bytes: int) -> None:
    if page_bytes > store.block_bytes:
        raise errors.InvalidArgumentError(f"a page of this cache is {page_bytes} bytes, the store's blocks hold "
                                          f"{store.block_bytes}")


def _is_sharded(arr: jax.Array) -> bool:
    """Spread over several devices, here or on other hosts (loads go shard by shard)."""
    return len(arr.addressable_shards) > 1 or not arr.is_fully_addressable


def _pages(a: np.ndarray, page_axis: int) -> np.ndarray:
    """A view of a host array with its pages axis first (writes go through)."""
    return np.moveaxis(a, page_axis, 0) if page_axis else a


def _page_nbytes(shape: Sequence[int], page_axis: int, dtype: np.dtype) -> int:
    return int(np.prod([d for i, d in enumerate(shape) if i != page_axis])) * dtype.itemsize


def _layer_shards(layers: Sequence[jax.Array], page_axis: int) -> tuple[int, dict[int, list[jax.Array]]]:
    """(shards per layer, {global shard number: that shard of every layer}) for this host."""
    total: int | None = None
    numbered: dict[int, list[jax.Array]] = {}
    for layer in layers:
        shard_shape = layer.sharding.shard_shape(layer.shape)
        if shard_shape[page_axis] != layer.shape[page_axis]:
            raise errors.InvalidArgumentError(
                f"the cache's pages axis (axis {page_axis}) is sharded ({layer.shape[page_axis]} pages, "
                f"{shard_shape[page_axis]} per shard): page ids are global, so shard layers, page slots or kv_heads "
                "instead")
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


def host_shards(layers: Sequence[jax.Array], *, page_axis: int = 0) -> tuple[int, list[int]]:
    """(shards each layer is split in, 1 unsharded; the global numbers of those this host holds).
    Each shard's part of a block is stored under its own key (`shard_key`)."""
    total, shards = _layer_shards(layers, page_axis)
    return total, list(shards)


def shard_keys(keys: Sequence[int], layers: Sequence[jax.Array], *, page_axis: int = 0) -> list[int]:
    """The pool keys save_pages stores these blocks under on this host: one per shard of each
    block held here (the block keys themselves when unsharded)."""
    total, shards = _layer_shards(layers, page_axis)
    return [shard_key(k, n, total) for k in keys for n in shards]


def block_bytes(layers: Sequence[jax.Array], *, page_axis: int = 0) -> int:
    """Bytes of one block (one page of every layer, one shard)."""
    return sum(_page_nbytes(layer.sharding.shard_shape(layer.shape), page_axis, layer.dtype) for layer in layers)


def _host_pages(data: jax.Array, page_ids: Sequence[int], page_axis: int) -> tuple[np.ndarray, list[int]]:
    """A host view of one layer's shard holding the wanted pages, pages first, and their index in it."""
    if next(iter(data.devices())).platform == "cpu":  # never pop: jax may hand out its own set
        data.block_until_ready()
        return _pages(np.asarray(data), page_axis), list(page_ids)  # the device buffer itself
    gathered = jnp.take(data, jnp.asarray(page_ids), axis=page_axis)  # one transfer of just these pages
    return _pages(np.asarray(gathered), page_axis), list(range(len(page_ids)))


def save_pages(store: KVStore, keys: Sequence[int], layers: Sequence[jax.Array], page_ids: Sequence[int], *,
               page_axis: int = 0) -> int:
    """Stores the given pages under `keys` (blocks already stored are skipped), each shard held
    here under its own key. Returns bytes written."""
    if len(keys) != len(page_ids):
        raise ValueError(f"{len(keys)} keys for {len(page_ids)} pages")
    total, shards = _layer_shards(layers, page_axis)
    written = 0
    for n, parts in shards.items():
        host = [_host_pages(p, page_ids, page_axis) for p in parts]
        sizes = [int(np.prod(h.shape[1:])) * h.dtype.itemsize for h, _ in host]
        nbytes = sum(sizes)
        _check_fits(store, nbytes)
        keyed = [shard_key(key, n, total) for key in keys]
        for g in range(0, len(keyed), _GROUP):  # reserved slots cannot be evicted: keep groups small
            with store.reserve_many(keyed[g:g + _GROUP]) as slots:
                for j, slot in enumerate(slots):
                    if slot is None:
                        continue  # already stored (content-addressed)
                    dst = np.frombuffer(slot.view, dtype=np.uint8, count=nbytes)
                    offset = 0
                    for (h, idx), size in zip(host, sizes):
                        np.copyto(dst[offset:offset + size].view(h.dtype).reshape(h.shape[1:]), h[idx[g + j]])
                        offset += size
                    del dst
                    slot.commit(nbytes)
                    written += nbytes
    return written


@partial(jax.jit, donate_argnums=(0,), static_argnums=(3,))
def _set_pages(layers: list[jax.Array], blocks: list[np.ndarray], page_ids: np.ndarray,
               page_axis: int) -> list[jax.Array]:
    """blocks: one [_GROUP, page...] array per layer; page_ids: [_GROUP] int32."""
    at = (slice(None),) * page_axis + (page_ids,)
    return [layer.at[at].set(jnp.moveaxis(block, 0, page_axis)) for layer, block in zip(layers, blocks)]


def _stage_blocks(store: KVStore, keys: list[int], staging: list[np.ndarray], sizes: list[int]) -> int:
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


def load_pages(store: KVStore, keys: Sequence[int], layers: Sequence[jax.Array], page_ids: Sequence[int], *,
               page_axis: int = 0) -> tuple[list[jax.Array], int]:
    """Loads stored blocks into the given pages: one jitted update of every layer per group of
    pages, the old layers donated. Returns the new layers and the number of leading pages
    loaded; loading stops at the first block the store lacks, or holds with another length than
    a page's (not a page of this cache: a miss, never loaded in part), or at a store error once
    a group is loaded (the layers passed in are gone by then; an error before that raises)."""
    layers = list(layers)
    if any(_is_sharded(layer) for layer in layers):
        return _load_sharded(store, keys, layers, page_ids, page_axis)
    shapes = [tuple(d for i, d in enumerate(layer.shape) if i != page_axis) for layer in layers]
    sizes = [_page_nbytes(layer.shape, page_axis, layer.dtype) for layer in layers]
    _check_fits(store, sum(sizes))
    loaded = 0
    for g in range(0, len(keys), _GROUP):
        group_keys, group_pages = list(keys[g:g + _GROUP]), list(page_ids[g:g + _GROUP])
        staging = [np.empty((_GROUP,) + s, layer.dtype) for s, layer in zip(shapes, layers)]
        try:
            present = _stage_blocks(store, group_keys, staging, sizes)
        except (errors.TpuSyncError, OSError):
            if loaded:  # the caller's layers were donated to earlier groups' updates: hand back the new ones
                break
            raise
        if present == 0:
            break
        for st in staging:
            st[present:] = st[present - 1]  # pad: rewriting the last page is harmless
        pids = group_pages[:present] + [group_pages[present - 1]] * (_GROUP - present)
        layers = _set_pages(layers, staging, np.asarray(pids, np.int32), page_axis)
        loaded += present
        if present < len(group_keys):
            break
    return list(layers), loaded


def compile_loads(layers: Sequence[jax.Array], *, page_axis: int = 0) -> list[jax.Array]:
    """Compiles load_pages' update for this cache (rewrites page 0 with its own content), so the
    first load is not compile time. Returns the new layers (the old are donated)."""
    layers = list(layers)
    if any(_is_sharded(layer) for layer in layers):
        return layers
    staging = [np.stack([np.asarray(jnp.take(layer, 0, axis=page_axis))] * _GROUP) for layer in layers]
    return list(_set_pages(layers, staging, np.zeros(_GROUP, np.int32), page_axis))


def _load_sharded(store: KVStore, keys: Sequence[int], layers: list[jax.Array], page_ids: Sequence[int],
                  page_axis: int) -> tuple[list[jax.Array], int]:
    """Each host loads its own shards of every layer into host copies and reassembles the global
    arrays. Loads the prefix every local shard has (a block evicted meanwhile, or of another
    length than a shard's page, shortens it)."""
    total, shards = _layer_shards(layers, page_axis)
    loaded = min(store.lookup([shard_key(key, n, total) for key in keys]).prefix_len for n in shards)
    if loaded == 0:
        return layers, 0
    host: dict[int, list[np.ndarray]] = {}
    copied: dict[int, int] = {}
    for n, parts in shards.items():
        arrays = [np.array(p) for p in parts]
        views = [_pages(a, page_axis) for a in arrays]
        sizes = [int(np.prod(v.shape[1:])) * v.dtype.itemsize for v in views]
        with store.acquire_many([shard_key(key, n, total) for key in keys[:loaded]]) as stored:
            for i, (view, pid) in enumerate(zip(stored, page_ids[:loaded])):
                if view is None or len(view) != sum(sizes):
                    loaded = i
                    break
                src = np.frombuffer(view, dtype=np.uint8, count=sum(sizes))
                offset = 0
                for v, size in zip(views, sizes):
                    v[pid] = src[offset:offset + size].view(v.dtype).reshape(v.shape[1:])
                    offset += size
                del src
        host[n], copied[n] = arrays, loaded
    return _finish_sharded(layers, host, copied, loaded, page_ids, shards, page_axis)


def _finish_sharded(layers: list[jax.Array], host: dict[int, list[np.ndarray]], copied: dict[int, int], loaded: int,
                    page_ids: Sequence[int], shards: dict[int, list[jax.Array]],
                    page_axis: int) -> tuple[list[jax.Array], int]:
    """The sharded loads' end: the host copies, their first `loaded` pages filled, made the global arrays."""
    if loaded == 0:
        return layers, 0
    _restore(host, copied, loaded, page_ids, shards, page_axis)
    return _assemble(layers, host), loaded


def _restore(host: dict[int, list[np.ndarray]], copied: dict[int, int], loaded: int, page_ids: Sequence[int],
             shards: dict[int, list[jax.Array]], page_axis: int) -> None:
    """A later shard ended the prefix sooner: puts back the pages past it that earlier shards
    copied, so no page holds some shards' new content and others' old."""
    for n, arrays in host.items():
        for pid in page_ids[loaded:copied[n]]:
            for a, part in zip(arrays, shards[n]):
                _pages(a, page_axis)[pid] = _pages(np.asarray(part), page_axis)[pid]


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


def source_parts(layers: Sequence[jax.Array], src_shards: int, axis: int) -> list[int]:
    """The parts of a block stored split in `src_shards` along `axis` that this host's shards
    overlap (what load_pages_resharded reads here)."""
    ranges = _axis_ranges(layers[0], axis)
    return sorted({m for r in ranges.values() for m, *_ in reshard_ranges(layers[0].shape[axis], src_shards, r)})


def _stored_parts(layers: list[jax.Array], src_shards: int, axis: int, page_axis: int,
                  src_page: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """The shape of each layer's part in a block stored split in `src_shards` along `axis`
    (pages of `src_page` tokens), and where each layer's part starts in the block (its last
    offset: the block's length). Refuses layers that cannot have been stored so."""
    token_axis = page_axis + 1
    page_tokens = layers[0].shape[token_axis]
    if axis in (page_axis, token_axis) or any(layer.shape[token_axis] != page_tokens for layer in layers):
        raise errors.InvalidArgumentError("the layers' pages must hold one number of tokens, split on another axis")
    ranges = _axis_ranges(layers[0], axis)
    if any(_axis_ranges(layer, axis) != ranges for layer in layers[1:]):
        raise errors.InvalidArgumentError("layers are sharded differently")
    part_shapes = []
    for layer in layers:
        if layer.shape[axis] % src_shards:
            raise errors.InvalidArgumentError(f"axis {axis} of a layer {layer.shape} cannot be split in {src_shards}")
        part_shapes.append(tuple(d // src_shards if i == axis else src_page if i == token_axis else d
                                 for i, d in enumerate(layer.shape) if i != page_axis))
    sizes = [int(np.prod(shape)) * layer.dtype.itemsize for shape, layer in zip(part_shapes, layers)]
    return part_shapes, np.cumsum([0] + sizes).tolist()


def load_pages_resharded(store: KVStore, keys: Sequence[int], layers: Sequence[jax.Array], page_ids: Sequence[int],
                         src_shards: int, axis: int, *, page_axis: int = 0, src_page_tokens: int = 0,
                         first_token: int = 0) -> tuple[list[jax.Array], int]:
    """Loads blocks that an engine with the same layers (but for their page size) stored split in
    `src_shards` equal parts along `axis` (`save_pages` of a cache sharded there), into this
    cache however it is split along that axis (tensor parallelism of another degree): each
    shard here reads only the stored parts it overlaps, no host gathers a whole block. The
    tokens of a page are the axis after the pages axis.

    `src_page_tokens`: the tokens of a stored block where that engine's pages held another
    number than this cache's (0: as here). The blocks of `keys` then hold consecutive tokens,
    from token `first_token` of keys[0], and each page here takes the token ranges of the
    blocks it overlaps (two blocks of 16 tokens for a page of 32, half a block of 32 for a
    page of 16: `page_ranges`). Returns the new layers and the number of leading pages loaded:
    a page loads only when every part this host needs of every block it overlaps is stored,
    with a part's length."""
    layers = list(layers)
    page_tokens = layers[0].shape[page_axis + 1]
    src_page = src_page_tokens or page_tokens
    part_shapes, offsets = _stored_parts(layers, src_shards, axis, page_axis, src_page)
    ranges = _axis_ranges(layers[0], axis)
    _check_fits(store, offsets[-1])
    _, shards = _layer_shards(layers, page_axis)
    heads = {n: reshard_ranges(layers[0].shape[axis], src_shards, ranges[n]) for n in shards}
    tokens = [page_ranges(page_tokens, src_page, first_token, j) for j in range(len(page_ids))]
    # In a page (the layer without its pages axis): where the tokens and the split axis are.
    t_axis, s_axis = page_axis, axis - 1 if axis > page_axis else axis

    def pages_within(blocks: int) -> int:  # leading pages whose blocks are all among the first `blocks`
        return next((j for j, t in enumerate(tokens) if t[-1][0] >= blocks), len(tokens))

    def parts(plan: list[tuple[int, int, int, int]], blocks: Sequence[int]) -> list[int]:
        return [shard_key(key, m, src_shards) for key in blocks for m, *_ in plan]

    loaded = len(page_ids)
    for plan in heads.values():
        loaded = min(loaded, pages_within(store.lookup(parts(plan, keys)).prefix_len // len(plan)))
    host: dict[int, list[np.ndarray]] = {}
    copied: dict[int, int] = {}
    for n, held in shards.items():
        if loaded == 0:
            break
        plan, arrays = heads[n], [np.array(p) for p in held]
        views = [_pages(a, page_axis) for a in arrays]
        blocks = tokens[loaded - 1][-1][0] + 1
        with store.acquire_many(parts(plan, keys[:blocks])) as stored:
            whole = next((b for b in range(blocks) if any(
                view is None or len(view) != offsets[-1]
                for view in stored[b * len(plan):(b + 1) * len(plan)])), blocks)
            loaded = min(loaded, pages_within(whole))  # evicted since the lookup, or not this model's pages
            for j, pid in enumerate(page_ids[:loaded]):
                for b, t_src, t_dst, t_count in tokens[j]:
                    for p, (_, h_src, h_dst, h_count) in enumerate(plan):
                        raw = np.frombuffer(cast(memoryview, stored[b * len(plan) + p]), dtype=np.uint8,
                                            count=offsets[-1])
                        for li, v in enumerate(views):
                            part = raw[offsets[li]:offsets[li + 1]].view(v.dtype).reshape(part_shapes[li])
                            src: list[slice] = [slice(None)] * part.ndim
                            dst: list[slice] = [slice(None)] * part.ndim
                            src[t_axis], dst[t_axis] = slice(t_src, t_src + t_count), slice(t_dst, t_dst + t_count)
                            src[s_axis], dst[s_axis] = slice(h_src, h_src + h_count), slice(h_dst, h_dst + h_count)
                            v[pid][tuple(dst)] = part[tuple(src)]
                        del raw
        host[n], copied[n] = arrays, loaded
    return _finish_sharded(layers, host, copied, loaded, page_ids, shards, page_axis)
