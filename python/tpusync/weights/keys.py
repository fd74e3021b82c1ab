"""Block keys of weight versions.

Every piece of a version has a 128-bit key derived from (model, version, what it is):
data blocks from (leaf name, shard index, block number, content checksum), manifest parts
from the manifest's SHA-256 and part number, the commit record from (version, "commit").
Versions never collide, and a half-written attempt is never mistaken for a later one with
other content.
"""

from __future__ import annotations

import hashlib
import numbers
from typing import Any

import cbor2

from tpusync import errors

_DOMAIN = "tpusync/weights/1"

Part = tuple[int, int]   # (index, count): one trainer process's share of a version

FIRST_VERSION = 1


def check_version(version: object, what: str = "version") -> int:
    """`version` as an int when it is a weight version: an integer >= 1. InvalidArgumentError
    naming `what` otherwise. The rule every entry point of the weight API and its CLI applies.

    Versions count a trainer's published updates from 1. The weights an engine starts with are
    not a version: "none yet" is None, and a host with none reads as head 0 (`await_version`'s
    `read_head(...) or 0`, the upstream synchronizer's next version `(current or 0) + 1`). A
    version 0 or below could be published, yet never be newer than "none": no sampler would
    ever wait for it or load it."""
    if isinstance(version, bool) or not isinstance(version, numbers.Integral) or version < FIRST_VERSION:
        raise errors.InvalidArgumentError(
            f"{what} must be an integer >= {FIRST_VERSION}, not {version!r}: versions count published updates "
            "from 1 (0 and below would never be newer than no version at all)")
    return int(version)


def weight_key(model: str, version: int, *parts: Any) -> int:
    """A 128-bit block key for one piece of one version of a model (no key exists for a version
    `check_version` refuses)."""
    digest = hashlib.sha256(cbor2.dumps([_DOMAIN, model, check_version(version), *parts], canonical=True)).digest()
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
