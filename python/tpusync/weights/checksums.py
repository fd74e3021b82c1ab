"""Block checksums of weight versions: the manifest records one per data block."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from tpusync import errors

try:  # xxhash is ~10x faster than any hashlib digest; it is a dev dependency today.
    import xxhash

    CHECKSUM = "xxh3-64"

    def checksum(buf: Any) -> int:
        """The 64-bit checksum of a buffer (XXH3-64, or BLAKE2b-64 without xxhash)."""
        return int(xxhash.xxh3_64_intdigest(_bytes_view(buf)))
except ImportError:  # pragma: no cover - depends on the environment
    CHECKSUM = "blake2b-64"

    def checksum(buf: Any) -> int:
        return _blake2b_64(buf)


# What the transfer engine computes over every block that lands (XXH3-64, seed 0).
WIRE_CHECKSUM = "xxh3-64"


def checksum_with(algo: str, buf: Any) -> int:
    """The checksum of `buf` by the algorithm a manifest names."""
    if algo == CHECKSUM:
        return checksum(buf)
    if algo == "blake2b-64":
        return _blake2b_64(buf)
    if algo == "xxh3-64":
        import xxhash  # raises ImportError with a clear name if absent

        return int(xxhash.xxh3_64_intdigest(_bytes_view(buf)))
    raise errors.InvalidArgumentError(f"unknown checksum algorithm {algo!r}")


def _blake2b_64(buf: Any) -> int:
    return int.from_bytes(hashlib.blake2b(_bytes_view(buf), digest_size=8).digest(), "little")


def _bytes_view(buf: Any) -> memoryview:
    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
    return memoryview(buf).cast("B")
