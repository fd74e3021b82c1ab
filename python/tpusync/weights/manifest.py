"""Versioned weight snapshots as blocks: keys, the manifest, the commit record, the host head.

A version of a model is stored as:

- data blocks: each (leaf, shard) of the pytree is cut into blocks of at most block_bytes;
  a block's key is derived from (model, version, leaf name, shard index, block number,
  content checksum), so versions never collide and a half-written attempt can never be
  mistaken for a later one with other content;
- the manifest (CBOR): pytree leaf names, shapes, dtypes, shardings, and per shard the
  blocks' keys, lengths and checksums (XXH3-64). It is split over as many blocks as it
  needs, keyed by (model, version, "manifest", its SHA-256, part number);
- the commit record (one small block, key (model, version, "commit")): the manifest's
  SHA-256, length and part keys. It is written last, after every other block of the
  version is stored, so its presence on a host means the version is complete there.

Blocks are content-addressed and never rewritten, so "which version is current on this
host" cannot be a block: it is the head file `<pool path>.weights/<model>.head` beside the
pool in /dev/shm (as durable as the pool itself), advanced only forward, atomically
(write + rename under a lock), and only after the commit record is stored.

A trainer spread over several hosts (JAX processes) publishes one *part* per process: its
shards, with a part manifest and a part commit record keyed by (index, count), and its own
part head. A destination that has landed every part merges the part manifests
(`merge_parts`, which checks that the shards cover every leaf) into the version's manifest,
and only then writes the commit record: samplers see whole versions only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import numpy as np

from tpusync import errors

FORMAT = 1
_DOMAIN = "tpusync/weights/1"

try:  # xxhash is ~10x faster than any hashlib digest; it is a dev dependency today.
    import xxhash

    CHECKSUM = "xxh3-64"

    def checksum(buf: Any) -> int:
        """The 64-bit checksum of a buffer (XXH3-64, or BLAKE2b-64 without xxhash)."""
        return xxhash.xxh3_64_intdigest(_bytes_view(buf))
except ImportError:  # pragma: no cover - depends on the environment
    CHECKSUM = "blake2b-64"

    def checksum(buf: Any) -> int:
        return int.from_bytes(hashlib.blake2b(_bytes_view(buf), digest_size=8).digest(), "little")


# What the transfer engine computes over every block that lands (XXH3-64, seed 0).
WIRE_CHECKSUM = "xxh3-64"


def checksum_with(algo: str, buf: Any) -> int:
    if algo == CHECKSUM:
        return checksum(buf)
    if algo == "blake2b-64":
        return int.from_bytes(hashlib.blake2b(_bytes_view(buf), digest_size=8).digest(), "little")
    if algo == "xxh3-64":
        import xxhash  # noqa: F811 - raises ImportError with a clear name if absent

        return xxhash.xxh3_64_intdigest(_bytes_view(buf))
    raise errors.InvalidArgumentError(f"unknown checksum algorithm {algo!r}")


def _bytes_view(buf: Any) -> memoryview:
    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
    return memoryview(buf).cast("B")


def weight_key(model: str, version: int, *parts: Any) -> int:
    """A 128-bit block key for one piece of one version of a model."""
    digest = hashlib.sha256(cbor2.dumps([_DOMAIN, model, int(version), *parts], canonical=True)).digest()
    return int.from_bytes(digest[:16], "big")


Part = tuple[int, int]   # (index, count): one trainer process's share of a version


def ref_key(model: str, version: int, part: Part | None = None) -> int:
    """A copy of the commit record that commits nothing: a receiver pulls it to learn the
    manifest's keys before the data (a commit record's presence on a host means complete)."""
    return weight_key(model, version, "manifest-ref", *(part or ()))


def commit_key(model: str, version: int, part: Part | None = None) -> int:
    """The commit record of a version, or of one part of it."""
    if part is None:
        return weight_key(model, version, "commit")
    return weight_key(model, version, "part-commit", part[0], part[1])


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
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


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

    # -- encoding ---------------------------------------------------------------------------

    def encode(self) -> bytes:
        return cbor2.dumps({
            "format": FORMAT, "model": self.model, "version": self.version, "block_bytes": self.block_bytes,
            "blocks_per_chunk": self.blocks_per_chunk, "checksum": self.checksum, "treedef": self.treedef,
            "leaves": [{
                "name": leaf.name, "shape": list(leaf.shape), "dtype": leaf.dtype, "sharding": leaf.sharding,
                "shards": [{
                    "index": [list(d) for d in shard.index],
                    "blocks": [[b.key.to_bytes(16, "big"), b.length, b.checksum] for b in shard.blocks],
                } for shard in leaf.shards],
            } for leaf in self.leaves],
        }, canonical=True)

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        m = cbor2.loads(data)
        if m.get("format") != FORMAT:
            raise errors.CorruptionError(f"weight manifest format {m.get('format')!r} is not {FORMAT}")
        leaves = tuple(LeafEntry(
            leaf["name"], tuple(leaf["shape"]), leaf["dtype"], leaf["sharding"],
            tuple(ShardEntry(tuple(tuple(d) for d in s["index"]),
                             tuple(BlockRef(int.from_bytes(k, "big"), n, c) for k, n, c in s["blocks"]))
                  for s in leaf["shards"]),
        ) for leaf in m["leaves"])
        return cls(m["model"], m["version"], m["block_bytes"], m["blocks_per_chunk"], m["checksum"], leaves,
                   m.get("treedef", ""))


@dataclass(frozen=True)
class CommitRecord:
    model: str
    version: int
    manifest_sha256: bytes
    manifest_bytes: int
    parts: tuple[int, ...]

    def encode(self) -> bytes:
        return cbor2.dumps({"format": FORMAT, "model": self.model, "version": self.version,
                            "sha256": self.manifest_sha256, "bytes": self.manifest_bytes,
                            "parts": [k.to_bytes(16, "big") for k in self.parts]}, canonical=True)

    @classmethod
    def decode(cls, data: bytes) -> CommitRecord:
        m = cbor2.loads(data)
        if m.get("format") != FORMAT:
            raise errors.CorruptionError(f"weight commit record format {m.get('format')!r} is not {FORMAT}")
        return cls(m["model"], m["version"], m["sha256"], m["bytes"], tuple(int.from_bytes(k, "big") for k in m["parts"]))


def manifest_blocks(manifest: Manifest) -> tuple[CommitRecord, list[tuple[int, bytes]]]:
    """The commit record and the manifest's (key, bytes) parts, each at most block_bytes."""
    data = manifest.encode()
    sha = hashlib.sha256(data).digest()
    step = manifest.block_bytes
    pieces = [data[i:i + step] for i in range(0, len(data), step)] or [b""]
    parts = [(weight_key(manifest.model, manifest.version, "manifest", sha, i), p) for i, p in enumerate(pieces)]
    return CommitRecord(manifest.model, manifest.version, sha, len(data), tuple(k for k, _ in parts)), parts


# -- reading and writing through a KVStore ------------------------------------------------------


def write_manifest(store: Any, manifest: Manifest, part: Part | None = None) -> CommitRecord:
    """Stores the manifest parts, then the commit record (the version's or the part's commit point)."""
    record, parts = manifest_blocks(manifest)
    empty = [k for k, p in parts if not p]
    if empty:
        raise errors.InvalidArgumentError("empty manifest")
    store.put([k for k, _ in parts], [p for _, p in parts])
    present = store.lookup([k for k, _ in parts]).prefix_len
    if present != len(parts):
        raise errors.CapacityError(f"stored {present} of {len(parts)} manifest parts")
    store.put([ref_key(manifest.model, manifest.version, part)], [record.encode()])
    store.put([commit_key(manifest.model, manifest.version, part)], [record.encode()])
    return record


def read_block(store: Any, key: int) -> bytes | None:
    """A whole stored block as bytes (its stored length), or None."""
    with store.acquire_many([key]) as views:
        return None if views[0] is None else bytes(views[0])


def read_commit(store: Any, model: str, version: int, part: Part | None = None, *,
                key: int | None = None) -> CommitRecord | None:
    data = read_block(store, commit_key(model, version, part) if key is None else key)
    return None if data is None else CommitRecord.decode(data)


def read_manifest(store: Any, model: str, version: int, part: Part | None = None, *,
                  record: CommitRecord | None = None) -> Manifest | None:
    """The committed manifest of a version (or of one part) in this store, or None if it is
    not committed here; with `record`, the manifest that record names."""
    record = record or read_commit(store, model, version, part)
    if record is None:
        return None
    pieces = []
    with store.acquire_many(list(record.parts)) as views:
        for view in views:
            if view is None:
                return None  # evicted since: the version is gone from this host
            pieces.append(bytes(view))
    data = b"".join(pieces)
    if len(data) != record.manifest_bytes or hashlib.sha256(data).digest() != record.manifest_sha256:
        raise errors.CorruptionError(f"manifest of {model!r} version {version} fails its SHA-256")
    manifest = Manifest.decode(data)
    if manifest.model != model or manifest.version != version:
        raise errors.CorruptionError(f"manifest names {manifest.model!r} v{manifest.version}, not {model!r} v{version}")
    return manifest


def verify_blocks(store: Any, blocks: Sequence[BlockRef], algo: str) -> list[BlockRef]:
    """Blocks that are missing or fail their checksum (empty when all are good)."""
    bad = []
    with store.acquire_many([b.key for b in blocks]) as views:
        for ref, view in zip(blocks, views):
            if view is None or len(view) < ref.length or checksum_with(algo, view[:ref.length]) != ref.checksum:
                bad.append(ref)
    return bad


# -- the host's head --------------------------------------------------------------------------


def head_path(pool_path: str, model: str, *, part: bool = False) -> str:
    """The host's head file for a model's whole versions, or (part=True) for its trainer part."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", model)[:64]
    tag = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"{pool_path}.weights/{safe}-{tag}.{'parthead' if part else 'head'}"


def _read_head_file(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def read_head(pool_path: str, model: str) -> int | None:
    """The newest version committed on this host, or None."""
    head = _read_head_file(head_path(pool_path, model))
    return None if head is None else int(head["version"])


def read_part_head(pool_path: str, model: str) -> tuple[int, Part] | None:
    """The newest version this host published a part of, and which part, or None."""
    head = _read_head_file(head_path(pool_path, model, part=True))
    return None if head is None else (int(head["version"]), (int(head["part"][0]), int(head["part"][1])))


def advance_head(pool_path: str, model: str, version: int, part: Part | None = None) -> int | None:
    """Makes `version` the host's current version (or part) if it is newer; returns the previous head."""
    path = head_path(pool_path, model, part=part is not None)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        head = _read_head_file(path)
        previous = None if head is None else int(head["version"])
        if previous is not None and previous >= version:
            return previous
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"model": model, "version": int(version), **({"part": list(part)} if part else {})}, f)
        os.replace(tmp, path)
        return previous


def version_keys(manifest: Manifest, part: Part | None = None) -> list[int]:
    """Every block key of a version (or part): data, manifest parts, commit record (commit last)."""
    _, parts = manifest_blocks(manifest)
    return [b.key for b in manifest.blocks()] + [k for k, _ in parts] + \
        [ref_key(manifest.model, manifest.version, part), commit_key(manifest.model, manifest.version, part)]


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


def commit_on_host(store: Any, manifest: Manifest, part: Part | None = None) -> None:
    """After the commit record is stored here: pin this version, advance the head, unpin the old one.

    One version per host stays pinned; a sampler still loading an older one holds read
    leases on its blocks, and one that finds them evicted moves on to the new head.
    """
    keys = version_keys(manifest, part)
    try:
        # Pinned for the host, not this process: the version stays when its committer exits.
        store.pin(keys, for_host=True)
    except errors.NotFoundError:
        missing = len(keys) - store.lookup(keys).prefix_len
        raise errors.NotFoundError(f"version {manifest.version} of {manifest.model!r}: {missing} blocks "
                                   "missing at commit (pool too small for two versions?)") from None
    # A host's previous part may be another (index, count): the trainer's layout can change.
    before = read_part_head(store.pool_path, manifest.model) if part is not None else None
    previous = advance_head(store.pool_path, manifest.model, manifest.version, part)
    if previous is not None and previous >= manifest.version:
        _release_quietly(store, keys)  # already current here (pinned once), or an older version arrived late
    elif previous is not None and previous < manifest.version:
        old_part = before[1] if before is not None else None
        old = read_manifest(store, manifest.model, previous, old_part)
        if old is not None:
            _release_quietly(store, version_keys(old, old_part))


def _release_quietly(store: Any, keys: list[int]) -> None:
    try:
        store.release(keys, for_host=True)
    except errors.TpuSyncError:
        for k in keys:  # some were never pinned here (e.g. a version a sampler found alone)
            try:
                store.release([k], for_host=True)
            except errors.TpuSyncError:
                pass


def iter_leaf_names(tree: Any) -> Iterator[tuple[str, Any]]:
    """(name, leaf) for every leaf of a pytree, names like 'layers/0/w'."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in flat:
        yield "/".join(_key_name(k) for k in path) or "<root>", leaf


def _key_name(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def describe(items: Iterable[str]) -> str:
    return ", ".join(items)
