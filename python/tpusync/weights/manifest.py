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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tpusync import errors
from tpusync.weights.tensors import itemsize


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
    every leaf must then be covered exactly, or the version is incomplete and refused."""
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
        covered = sum(int(np.prod(s.shape, dtype=np.int64)) for s in shards.values())
        if covered != int(np.prod(leaf.shape, dtype=np.int64)):
            raise errors.PreconditionError(f"the parts cover {covered} of {int(np.prod(leaf.shape))} elements of "
                                           f"leaf {leaf.name!r}: a trainer process's part is missing")
        leaves.append(LeafEntry(leaf.name, leaf.shape, leaf.dtype, leaf.sharding,
                                tuple(shards[i] for i in sorted(shards))))
    return Manifest(first.model, first.version, first.block_bytes, first.blocks_per_chunk, first.checksum,
                    tuple(leaves), first.treedef)


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
