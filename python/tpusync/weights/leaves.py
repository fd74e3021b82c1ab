"""Reading one leaf of a stored version off a host's pool: its bytes, whole."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tpusync import errors
from tpusync.weights.checksums import checksum
from tpusync.weights.manifest import BlockRef, LeafEntry
from tpusync.weights.tensors import itemsize

_GROUP = 16  # blocks acquired at once


class VersionGoneError(errors.NotFoundError):
    """A version's blocks left this host's pool while it was being loaded (a newer one is current)."""


def single_block(entry: LeafEntry) -> bool:
    """The leaf is one shard in one block: it can be used in place, on the pool slot."""
    return len(entry.shards) == 1 and entry.shards[0].shape == entry.shape and len(entry.shards[0].blocks) == 1


def leaf_in_place(store: Any, entry: LeafEntry, *, verify: bool, lease: Any = None) -> np.ndarray:
    """A one-block leaf's bytes on the pool slot itself; the view holds the block's read lease
    (the store refuses to close while one is held) for as long as it, or an array over it, lives.
    `lease`: the block's, acquired already (store.acquire_each for many leaves at once)."""
    ref = entry.shards[0].blocks[0]
    try:
        lease = store.acquire(ref.key) if lease is None else lease
    except errors.NotFoundError:
        lease = None
    if lease is None:
        raise VersionGoneError(f"leaf {entry.name!r}: a block is missing from this host's pool")
    view = np.frombuffer(memoryview(lease), np.uint8, count=ref.length)
    if verify and checksum(view) != ref.checksum:
        raise errors.CorruptionError(f"leaf {entry.name!r}: a block fails its checksum")
    return view


def leaf_leases(store: Any, entries: Sequence[LeafEntry]) -> dict[str, Any]:
    """{leaf name: its block's read lease (None where absent)} for one-block leaves used in
    place, taken in one round trip to a sidecar (leaf_in_place's `lease`)."""
    if not entries:
        return {}
    return dict(zip((e.name for e in entries), store.acquire_each([e.shards[0].blocks[0].key for e in entries])))


def leaf_bytes(store: Any, entry: LeafEntry, *, verify: bool) -> np.ndarray:
    """The whole leaf's bytes in a buffer of its own (C order, 64-byte aligned, so a CPU device
    can alias it), its shards put in place: the buffer starts uninitialised, so the entry must
    come from a checked manifest (storage.read_manifest: shards that tile the leaf). Raises
    VersionGoneError when a block is missing."""
    size = itemsize(entry.dtype)
    out = aligned_empty(entry.nbytes)
    if len(entry.shards) == 1:
        copy_blocks(store, entry.name, entry.shards[0].blocks, out, verify=verify)
        return out
    # Shards are regions of the global array: place them through an element-sized view.
    grid = out.view(f"V{size}").reshape(entry.shape)
    for shard in entry.shards:
        piece = np.empty(int(np.prod(shard.shape, dtype=np.int64)) * size, np.uint8)
        copy_blocks(store, entry.name, shard.blocks, piece, verify=verify)
        grid[tuple(slice(a, b) for a, b in shard.index)] = piece.view(f"V{size}").reshape(shard.shape)
    return out


def copy_blocks(store: Any, leaf: str, blocks: Sequence[BlockRef], out: np.ndarray, *, verify: bool) -> None:
    off = 0
    for g in range(0, len(blocks), _GROUP):
        group = blocks[g:g + _GROUP]
        with store.acquire_many([b.key for b in group]) as views:
            for ref, view in zip(group, views):
                if view is None or len(view) < ref.length:
                    raise VersionGoneError(f"leaf {leaf!r}: a block is missing from this host's pool")
                src = np.frombuffer(view, np.uint8, count=ref.length)
                if verify and checksum(src) != ref.checksum:
                    raise errors.CorruptionError(f"leaf {leaf!r}: block {g} fails its checksum")
                out[off:off + ref.length] = src
                off += ref.length
            del src
    if off != out.size:
        raise errors.CorruptionError(f"leaf {leaf!r}: blocks hold {off} bytes, the shard needs {out.size}")


def aligned_empty(nbytes: int, align: int = 64) -> np.ndarray:
    """An uninitialised uint8 buffer whose data is `align`-byte aligned."""
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]
