"""The stored form of manifests and commit records: canonical CBOR, versioned by FORMAT, and
the manifest cut into parts of at most one block each."""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2

from tpusync import errors
from tpusync.weights.keys import weight_key
from tpusync.weights.manifest import BlockRef, CommitRecord, LeafEntry, Manifest, ShardEntry

FORMAT = 1


def encode_manifest(m: Manifest) -> bytes:
    return bytes(cbor2.dumps({
        "format": FORMAT, "model": m.model, "version": m.version, "block_bytes": m.block_bytes,
        "blocks_per_chunk": m.blocks_per_chunk, "checksum": m.checksum, "treedef": m.treedef,
        "leaves": [{
            "name": leaf.name, "shape": list(leaf.shape), "dtype": leaf.dtype, "sharding": leaf.sharding,
            "shards": [{
                "index": [list(d) for d in shard.index],
                "blocks": [[b.key.to_bytes(16, "big"), b.length, b.checksum] for b in shard.blocks],
            } for shard in leaf.shards],
        } for leaf in m.leaves],
    }, canonical=True))


def decode_manifest(data: bytes) -> Manifest:
    """The manifest in `data`; CorruptionError if it is malformed. Whether its shards tile its
    leaves is `manifest.check_manifest`'s to say (storage.read_manifest asks it)."""
    m = _load(data, "weight manifest")
    try:
        leaves = tuple(LeafEntry(
            str(leaf["name"]), tuple(int(n) for n in leaf["shape"]), str(leaf["dtype"]), str(leaf["sharding"]),
            tuple(ShardEntry(tuple((int(a), int(b)) for a, b in s["index"]),
                             tuple(BlockRef(int.from_bytes(k, "big"), int(n), int(c)) for k, n, c in s["blocks"]))
                  for s in leaf["shards"]),
        ) for leaf in m["leaves"])
        return Manifest(str(m["model"]), int(m["version"]), int(m["block_bytes"]), int(m["blocks_per_chunk"]),
                        str(m["checksum"]), leaves, str(m.get("treedef", "")))
    except (KeyError, TypeError, ValueError) as e:
        raise errors.CorruptionError(f"weight manifest is malformed: {type(e).__name__}: {e}") from None


def encode_commit(r: CommitRecord) -> bytes:
    return bytes(cbor2.dumps({"format": FORMAT, "model": r.model, "version": r.version,
                              "sha256": r.manifest_sha256, "bytes": r.manifest_bytes,
                              "parts": [k.to_bytes(16, "big") for k in r.parts]}, canonical=True))


def decode_commit(data: bytes) -> CommitRecord:
    m = _load(data, "weight commit record")
    return CommitRecord(m["model"], m["version"], m["sha256"], m["bytes"],
                        tuple(int.from_bytes(k, "big") for k in m["parts"]))


def manifest_digest(manifest: Manifest) -> str:
    """The SHA-256 of the manifest's stored form (the commit record's), in hex: a version's identity."""
    return hashlib.sha256(encode_manifest(manifest)).hexdigest()


def manifest_blocks(manifest: Manifest) -> tuple[CommitRecord, list[tuple[int, bytes]]]:
    """The commit record and the manifest's (key, bytes) parts, each at most block_bytes."""
    data = encode_manifest(manifest)
    sha = hashlib.sha256(data).digest()
    step = manifest.block_bytes
    pieces = [data[i:i + step] for i in range(0, len(data), step)] or [b""]
    parts = [(weight_key(manifest.model, manifest.version, "manifest", sha, i), p) for i, p in enumerate(pieces)]
    return CommitRecord(manifest.model, manifest.version, sha, len(data), tuple(k for k, _ in parts)), parts


def _load(data: bytes, what: str) -> dict[str, Any]:
    m = cbor2.loads(data)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise errors.CorruptionError(f"{what} format {got!r} is not {FORMAT}")
    return m
