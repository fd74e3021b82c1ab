"""Block keys: chained prefix hashes over (parent, block tokens, extra keys).

The scheme is vLLM's `sha256_cbor` prefix hashing, which llm-d's precise prefix-cache
indexer recomputes from KV events, so a key the engine stores under is the key the router
looks up (docs/block-keys.md):

    root      = SHA-256(CBOR(seed))                      # seed: a string, never PYTHONHASHSEED's accident
    digest_i  = SHA-256(CBOR([digest_{i-1}, [t_0 .. t_{B-1}], extra]))
    key_i     = the low 128 bits of digest_i              # the store's block key
    event_i   = the low 64 bits of digest_i              # the hash in BlockStored events

CBOR is canonical (RFC 8949 §4.2): the parent as a 32-byte byte string, the tokens as an
array of unsigned integers, `extra` as null or an array (e.g. a LoRA name). Only full
blocks are hashed: a trailing partial block has no key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

DEFAULT_SEED = "tpusync"


def _digest(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@dataclass(frozen=True)
class BlockHasher:
    """Computes the keys of a token sequence's full blocks, deterministically across processes."""

    block_size: int
    seed: str = DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")

    @property
    def root(self) -> bytes:
        return _digest(self.seed)

    def digests(self, tokens: Sequence[int], extra: Sequence[Any] | None = None,
                parent: bytes | None = None) -> list[bytes]:
        """32-byte digests of every full block of `tokens`, chained from `parent` (default: root)."""
        prev = self.root if parent is None else parent
        extra_part = list(extra) if extra else None
        out = []
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            block = [int(t) for t in tokens[start:start + self.block_size]]
            prev = _digest([prev, block, extra_part])
            out.append(prev)
        return out

    def keys(self, tokens: Sequence[int], extra: Sequence[Any] | None = None) -> list[int]:
        """128-bit store keys of every full block."""
        return [key_of(d) for d in self.digests(tokens, extra)]


def key_of(digest: bytes) -> int:
    """The store key of a block digest: its low 128 bits."""
    return int.from_bytes(digest[16:], "big")


def event_hash_of(digest: bytes) -> int:
    """The 64-bit block hash llm-d reads from KV events: the digest's low 64 bits."""
    return int.from_bytes(digest[24:], "big")
