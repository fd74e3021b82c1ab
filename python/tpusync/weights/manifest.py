"""The data model of a weight version: what its manifest and commit record say.

A version of a model is stored as:

- data blocks: each (leaf, shard) of the pytree is cut into blocks of at most block_bytes,
  keyed as keys.py says;
- the manifest: pytree leaf names, shapes, dtypes, shardings, and per shard the blocks'
  keys, lengths and checksums (checksums.py). Encoded in CBOR (codec.py) and split over as
  many blocks as it needs;
- the commit record: the manifest's SHA-256, length and part keys. It is written last, after
  every other block of the version is stored (storage.py), so its presence on a host means
  the version is complete there; the host's head (head.py) then moves to it.

A trainer spread over several hosts (JAX processes) publishes one *part* per process: its
shards, with a part manifest and a part commit record keyed by (index, count). A destination
that has landed every part merges the part manifests (`merge_parts`, which checks that the
shards cover every leaf) into the version's manifest, and only then writes the commit
record: samplers see whole versions only.

Every manifest is checked before it is used (`check_manifest`, where one is read or written,
and after a merge): each leaf's shards must tile it exactly (inside the leaf, no two
overlapping, covering it; a part only the first two), and each shard's blocks must hold
exactly its bytes. A sampler fills a leaf shard by shard into an uninitialised buffer, so a
manifest that is not a tiling would leave part of a leaf as whatever memory held before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpusync import errors
from tpusync.weights.tensors import DTYPES, itemsize


@dataclass(frozen=True)
class BlockRef:
    key: int
    length: int
    checksum: int


@dataclass(frozen=True)
class ShardEntry:
    index: tuple[tuple[int, int], ...]  # [start, stop) per dimension, in the global array
    blocks: tuple[BlockRef, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.index)


@dataclass(frozen=True)
class LeafEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: str
    shards: tuple[ShardEntry, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize(self.dtype)


@dataclass(frozen=True)
class Manifest:
    model: str
    version: int
    block_bytes: int
    blocks_per_chunk: int
    checksum: str
    leaves: tuple[LeafEntry, ...]
    treedef: str = ""

    def blocks(self) -> list[BlockRef]:
        """Every data block, in transfer order (leaf, shard, block)."""
        return [b for leaf in self.leaves for shard in leaf.shards for b in shard.blocks]

    def chunks(self) -> list[list[BlockRef]]:
        """Data blocks grouped into transfer chunks (consecutive runs of blocks_per_chunk)."""
        blocks = self.blocks()
        n = self.blocks_per_chunk
        return [blocks[i:i + n] for i in range(0, len(blocks), n)]

    @property
    def nbytes(self) -> int:
        return sum(b.length for b in self.blocks())

    def leaf(self, name: str) -> LeafEntry:
        for leaf in self.leaves:
            if leaf.name == name:
                return leaf
        raise errors.NotFoundError(f"leaf {name!r} is not in version {self.version} of {self.model!r}")


@dataclass(frozen=True)
class CommitRecord:
    model: str
    version: int
    manifest_sha256: bytes
    manifest_bytes: int
    parts: tuple[int, ...]   # the keys of the manifest's parts, in order


def merge_parts(parts: Sequence[Manifest]) -> Manifest:
    """The manifest of a whole version from its trainer parts (one per process, any order).

    Shards are united by their index (a shard two parts both hold must be the same blocks);
    the shards must then tile every leaf: overlapping parts are refused as corrupt, a leaf
    not covered as incomplete (a part is missing)."""
    first = parts[0]
    for m in parts[1:]:
        if (m.model, m.version, m.block_bytes, m.checksum, m.treedef) != \
                (first.model, first.version, first.block_bytes, first.checksum, first.treedef):
            raise errors.CorruptionError(f"parts of {first.model!r} version {first.version} disagree on "
                                         "model, block size, checksum or pytree structure")
    leaves = []
    for leaf in first.leaves:
        shards: dict[tuple[tuple[int, int], ...], ShardEntry] = {}
        for m in parts:
            other = m.leaf(leaf.name)
            if (other.shape, other.dtype) != (leaf.shape, leaf.dtype):
                raise errors.CorruptionError(f"leaf {leaf.name!r} has shape/dtype {other.shape}/{other.dtype} in "
                                             f"one part and {leaf.shape}/{leaf.dtype} in another")
            for shard in other.shards:
                if shards.setdefault(shard.index, shard).blocks != shard.blocks:
                    raise errors.CorruptionError(f"two parts hold different data for shard {shard.index} "
                                                 f"of leaf {leaf.name!r}")
        problem = tiling_problem(leaf.shape, list(shards), whole=False)
        if problem is not None:
            raise errors.CorruptionError(f"the parts of {first.model!r} version {first.version} do not tile leaf "
                                         f"{leaf.name!r}: {problem}")
        covered = sum(int(np.prod(s.shape, dtype=np.int64)) for s in shards.values())
        if covered != int(np.prod(leaf.shape, dtype=np.int64)):
            raise errors.PreconditionError(f"the parts cover {covered} of {int(np.prod(leaf.shape))} elements of "
                                           f"leaf {leaf.name!r}: a trainer process's part is missing")
        leaves.append(LeafEntry(leaf.name, leaf.shape, leaf.dtype, leaf.sharding,
                                tuple(shards[i] for i in sorted(shards))))
    whole = Manifest(first.model, first.version, first.block_bytes, first.blocks_per_chunk, first.checksum,
                     tuple(leaves), first.treedef)
    check_manifest(whole)
    return whole


Index = tuple[tuple[int, int], ...]


def tiling_problem(shape: tuple[int, ...], indexes: Sequence[Index], *, whole: bool = True) -> str | None:
    """What keeps the shards at `indexes` ([start, stop) per dimension) from tiling a leaf of
    `shape` exactly: a shard outside the leaf or empty, two shards overlapping, or (`whole`)
    elements no shard covers. None when they tile it (a part's shards: lie in it, disjoint)."""
    for index in indexes:
        if len(index) != len(shape) or any(not 0 <= a < b <= n for (a, b), n in zip(index, shape)):
            return f"shard {_show(index)} is empty or outside the leaf's shape {shape}"
    if len(indexes) > 1:
        lo = np.array([[a for a, _ in i] for i in indexes], np.int64)
        hi = np.array([[b for _, b in i] for i in indexes], np.int64)
        for start in range(0, len(indexes), _ROWS):  # rows at a time: memory bounded by _ROWS * shards
            rows = slice(start, start + _ROWS)
            meet: np.ndarray = np.all((lo[rows, None] < hi[None]) & (lo[None] < hi[rows, None]), axis=2)
            np.fill_diagonal(meet[:, start:], False)
            if meet.any():
                i, j = np.argwhere(meet)[0]
                return f"shards {_show(indexes[start + i])} and {_show(indexes[j])} overlap"
    covered = sum(int(np.prod([b - a for a, b in i], dtype=np.int64)) for i in indexes)
    total = int(np.prod(shape, dtype=np.int64))
    if whole and covered != total:  # disjoint shards inside the leaf: equal counts mean covering
        return f"the shards cover {covered} of its {total} elements"
    return None


def check_manifest(manifest: Manifest, *, whole: bool = True) -> None:
    """Raises CorruptionError, naming the leaf and the shards, unless every leaf's shards tile
    it (`tiling_problem`; a part's need not cover it) and every shard's blocks hold exactly its
    bytes, each block 1 to block_bytes long. Nothing of such a version may reach a sampler."""
    where = f"version {manifest.version} of {manifest.model!r}" + ("" if whole else " (a part)")
    seen: set[str] = set()
    for leaf in manifest.leaves:
        if leaf.name in seen:
            raise errors.CorruptionError(f"leaf {leaf.name!r} appears twice in {where}")
        seen.add(leaf.name)
        if leaf.dtype not in DTYPES or any(n < 0 for n in leaf.shape):
            raise errors.CorruptionError(f"leaf {leaf.name!r} of {where}: shape {leaf.shape} of {leaf.dtype!r} "
                                         "is no array tpusync publishes")
        problem = tiling_problem(leaf.shape, [s.index for s in leaf.shards], whole=whole)
        if problem is not None:
            raise errors.CorruptionError(f"leaf {leaf.name!r} of {where}: {problem}")
        for shard in leaf.shards:
            need = int(np.prod(shard.shape, dtype=np.int64)) * itemsize(leaf.dtype)
            held = sum(b.length for b in shard.blocks)
            if held != need or any(not 0 < b.length <= manifest.block_bytes for b in shard.blocks):
                raise errors.CorruptionError(
                    f"leaf {leaf.name!r} of {where}: the blocks of shard {_show(shard.index)} hold {held} bytes "
                    f"in {len(shard.blocks)} blocks of at most {manifest.block_bytes}; it needs {need}")


_ROWS = 256


def _show(index: Index) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in index) + "]"


def source_chunks(held: dict[str, Manifest], per: int) -> dict[str, list[list[BlockRef]]]:
    """Each source host's transfer chunks (runs of `per` blocks) of what it holds; a block two
    sources both hold travels from the first one listed. At least one (maybe empty) chunk each."""
    out: dict[str, list[list[BlockRef]]] = {}
    seen: set[int] = set()
    for host, m in held.items():
        mine = [b for b in m.blocks() if b.key not in seen]
        seen.update(b.key for b in mine)
        out[host] = [mine[i:i + per] for i in range(0, len(mine), per)] or [[]]
    return out
