"""Weight versions in a block store: writing and reading manifests and commit records,
checking data blocks, and committing a version on a host (pins and the head).

`store` is a KVStore (local, over the pod's sidecar, or over a data port)."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any

from tpusync import errors
from tpusync.weights.checksums import checksum_with
from tpusync.weights.codec import decode_commit, decode_manifest, encode_commit, manifest_blocks
from tpusync.weights.head import advance_head, read_part_head
from tpusync.weights.keys import Part, commit_key, ref_key
from tpusync.weights.manifest import BlockRef, CommitRecord, Manifest, check_manifest


def write_manifest(store: Any, manifest: Manifest, part: Part | None = None) -> CommitRecord:
    """Stores the manifest parts, then the commit record (the version's or the part's commit point).
    A manifest whose shards do not tile its leaves is refused (CorruptionError) before anything is stored."""
    check_manifest(manifest, whole=part is None)
    record, parts = manifest_blocks(manifest)
    empty = [k for k, p in parts if not p]
    if empty:
        raise errors.InvalidArgumentError("empty manifest")
    store.put([k for k, _ in parts], [p for _, p in parts])
    present = store.lookup([k for k, _ in parts]).prefix_len
    if present != len(parts):
        raise errors.CapacityError(f"stored {present} of {len(parts)} manifest parts")
    store.put([ref_key(manifest.model, manifest.version, part)], [encode_commit(record)])
    store.put([commit_key(manifest.model, manifest.version, part)], [encode_commit(record)])
    return record


def read_block(store: Any, key: int) -> bytes | None:
    """A whole stored block as bytes (its stored length), or None."""
    with store.acquire_many([key]) as views:
        return None if views[0] is None else bytes(views[0])


def read_commit(store: Any, model: str, version: int, part: Part | None = None, *,
                key: int | None = None) -> CommitRecord | None:
    data = read_block(store, commit_key(model, version, part) if key is None else key)
    return None if data is None else decode_commit(data)


def read_manifest(store: Any, model: str, version: int, part: Part | None = None, *,
                  record: CommitRecord | None = None) -> Manifest | None:
    """The committed manifest of a version (or of one part) in this store, or None if it is
    not committed here; with `record`, the manifest that record names. Every manifest a host
    uses comes through here: one whose shards do not tile its leaves (or a part's, that lie
    outside them or overlap) raises CorruptionError naming the leaf and the shards, so the
    version is refused and a sampler stays on the version it has."""
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
    manifest = decode_manifest(data)
    if manifest.model != model or manifest.version != version:
        raise errors.CorruptionError(f"manifest names {manifest.model!r} v{manifest.version}, not {model!r} v{version}")
    check_manifest(manifest, whole=part is None)
    return manifest


def verify_blocks(store: Any, blocks: Sequence[BlockRef], algo: str) -> list[BlockRef]:
    """Blocks that are missing or fail their checksum (empty when all are good)."""
    bad = []
    with store.acquire_many([b.key for b in blocks]) as views:
        for ref, view in zip(blocks, views):
            if view is None or len(view) < ref.length or checksum_with(algo, view[:ref.length]) != ref.checksum:
                bad.append(ref)
    return bad


def version_keys(manifest: Manifest, part: Part | None = None) -> list[int]:
    """Every block key of a version (or part): data, manifest parts, commit record (commit last)."""
    _, parts = manifest_blocks(manifest)
    return [b.key for b in manifest.blocks()] + [k for k, _ in parts] + \
        [ref_key(manifest.model, manifest.version, part), commit_key(manifest.model, manifest.version, part)]


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
            with contextlib.suppress(errors.TpuSyncError):
                store.release([k], for_host=True)
