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

`BlockScope` holds, in one place, everything besides the tokens that makes two blocks' bytes
differ; the chain's hasher, the extra keys of served weights, the keys of a block's shards,
SGLang's key namespace (tpusync.engines.sglang.keys) and the KV layout a prefill engine tells
its decode engines all derive from it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import cbor2

from tpusync.kv.handoff import kv_layout

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


def shard_key(key: int, shard: int, shards: int) -> int:
    """The key of one shard's part of a block (the block key itself when unsharded). The split
    is part of the key: shard 0 of 2 and shard 0 of 4 hold other heads, so an engine of
    another tensor parallelism never takes one for the other. Its own inverse."""
    if shards == 1:
        return key
    return (key ^ (0x9E3779B97F4A7C15_2545F4914F6CDD1D * ((shards << 32) | (shard + 1)))) & ((1 << 128) - 1)


@dataclass(frozen=True)
class BlockScope:
    """What makes two blocks of the same tokens hold other bytes, in one place. Engines that
    share blocks agree on all of it but `shards` (loaded regrouped where they reshard) and
    `page_tokens` (keyed again at the other size where they regroup pages)."""

    model: str            # the model's name as the engine knows it
    dtype: str            # the KV cache's element type
    layers: int
    kv_heads: int
    head_size: int
    page_tokens: int      # tokens per block
    format: str           # how the engine arranges a block's bytes (tpusync.kv.handoff.FORMAT_*)
    shards: int = 1       # the parts a block is stored in, one per tensor-parallel shard
    seed: str = DEFAULT_SEED   # the key chain's seed (docs/block-keys.md)
    weights: str | None = None  # the served weights' tag (tpusync.kv.served_weights); None: as started

    def hasher(self, page_tokens: int | None = None) -> BlockHasher:
        """The key chain, at this scope's block size or another's (a prefill paged otherwise)."""
        return BlockHasher(page_tokens or self.page_tokens, self.seed)

    def extra(self, extra: Sequence[str] = ()) -> list[str] | None:
        """The chain's extra keys for a request with `extra` (LoRA, cache salt): the served
        weights' tag after them, so blocks of other weights never share a key."""
        out = list(extra) + ([f"weights:{self.weights}"] if self.weights is not None else [])
        return out or None

    def keys(self, tokens: Sequence[int], extra: Sequence[str] = ()) -> list[int]:
        return self.hasher().keys(tokens, self.extra(extra))

    def shard_key(self, key: int, shard: int) -> int:
        return shard_key(key, shard, self.shards)

    def layout(self) -> dict[str, Any]:
        """What a prefill engine tells its decode engines about its blocks (kv_transfer_params)."""
        return kv_layout(model=self.model, layers=self.layers, kv_heads=self.kv_heads, head_size=self.head_size,
                         dtype=self.dtype, shards=self.shards, format=self.format)

    def identity(self) -> str:
        """Every field, in one canonical string: what a key scheme that does not chain from this
        scope (SGLang's namespace) binds its keys to."""
        return (f"{self.model}|{self.dtype}|layers{self.layers}|heads{self.kv_heads}x{self.head_size}"
                f"|page{self.page_tokens}|{self.format}|shards{self.shards}|seed:{self.seed}|weights:{self.weights}")

    def under(self, weights: str | None) -> BlockScope:
        """This scope for blocks computed under the weights `weights` names."""
        return self if weights == self.weights else replace(self, weights=weights)
