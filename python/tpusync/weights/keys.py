"""Block keys of weight versions.

Every piece of a version has a 128-bit key derived from (model, version, what it is):
data blocks from (leaf name, shard index, block number, content checksum), manifest parts
from the manifest's SHA-256 and part number, the commit record from (version, "commit").
Versions never collide, and a half-written attempt is never mistaken for a later one with
other content.
"""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2

_DOMAIN = "tpusync/weights/1"

Part = tuple[int, int]   # (index, count): one trainer process's share of a version


def weight_key(model: str, version: int, *parts: Any) -> int:
    """A 128-bit block key for one piece of one version of a model."""
    digest = hashlib.sha256(cbor2.dumps([_DOMAIN, model, int(version), *parts], canonical=True)).digest()
    return int.from_bytes(digest[:16], "big")


def ref_key(model: str, version: int, part: Part | None = None) -> int:
    """A copy of the commit record that commits nothing: a receiver pulls it to learn the
    manifest's keys before the data (a commit record's presence on a host means complete)."""
    return weight_key(model, version, "manifest-ref", *(part or ()))


def commit_key(model: str, version: int, part: Part | None = None) -> int:
    """The commit record of a version, or of one part of it."""
    if part is None:
        return weight_key(model, version, "commit")
    return weight_key(model, version, "part-commit", part[0], part[1])
