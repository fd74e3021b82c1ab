"""Block keys of SGLang HiCache pages in a tpusync store.

SGLang names a page by a hash string of its tokens and the pages before it (the same on every
rank: sglang/srt/mem_cache/hicache_storage.py, HiCacheStorage.batch_exists gets the same keys
on every TP rank). One page of a rank's host pool holds that rank's share of the page (its KV
heads, its layers), so a block key binds the page hash to everything that changes the bytes:

    namespace = "tpusync-sglang/2" | block scope | ranks | geometry | chunk bytes
    key       = BLAKE2b-128(namespace | page hash | slot)     # 16 bytes, big-endian as the store reads it

The block scope is the KV plane's (tpusync.kv.keys.BlockScope.identity: model, dtype, layers,
heads, page tokens, the pool's layout as the format, the shard split), read from the host pool
(`block_scope`). `ranks` is tp_rank/tp_size, dp_rank, pp_rank/pp_size and attn_cp_rank/size for
MHA models; an MLA model's latent is the same on every TP rank (SGLang writes it from one rank
only: HiCacheStorageConfig.is_storage_writer), so its keys leave TP and DP out and every rank
reads the one copy (the DCP shard stays in). `geometry` is the page's buffer sizes (PagePlan),
which also parts pools that do not say their heads. `slot` names the part of the page ("k", "v",
or MLA's "latent") and the chunk of it ("k.0", "k.1", ... when a part exceeds a store block).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tpusync.kv.keys import BlockScope

VERSION = "tpusync-sglang/2"


def block_scope(pool: Any, *, model: str, mla: bool, tp_size: int) -> BlockScope:
    """The KV plane's scope of one rank's pages, from SGLang's host pool (read by attribute: no
    SGLang import here). MHA pools hold `head_num` x `head_dim` per layer (pool_host/mha.py), MLA
    pools one latent row of `kv_cache_dim` (pool_host/mla.py); SGLang's other pools say neither,
    and their page geometry, in the namespace too, keeps them apart."""
    if mla:
        kv_heads, head_size = 1, int(getattr(pool, "kv_cache_dim", 0) or 0)
    else:
        kv_heads, head_size = int(getattr(pool, "head_num", 0) or 0), int(getattr(pool, "head_dim", 0) or 0)
    return BlockScope(model=model, dtype=str(pool.dtype), layers=int(getattr(pool, "layer_num", 0) or 0),
                      kv_heads=kv_heads, head_size=head_size, page_tokens=int(pool.page_size),
                      format=f"sglang-{pool.layout}", shards=1 if mla else tp_size)


@dataclass(frozen=True)
class KeyScope:
    """What, besides the page hash, makes a page's bytes differ: the plane's block scope and
    where this rank's share of the page sits."""

    block: BlockScope
    mla: bool
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    geometry: str = ""
    chunk_bytes: int = 0

    @classmethod
    def from_config(cls, config: Any, pool: Any, *, model: str | None, geometry: str, chunk_bytes: int) -> KeyScope:
        """From SGLang's HiCacheStorageConfig and the host pool (read by attribute: no SGLang import here)."""
        mla, tp_size = bool(config.is_mla_model), int(config.tp_size)
        block = block_scope(pool, model=model if model is not None else (config.model_name or ""), mla=mla,
                            tp_size=tp_size)
        return cls(block=block, mla=mla,
                   tp_rank=int(config.tp_rank), tp_size=tp_size,
                   dp_rank=int(getattr(config, "dp_rank", 0) or 0),
                   pp_rank=int(config.pp_rank), pp_size=int(config.pp_size),
                   cp_rank=int(getattr(config, "attn_cp_rank", 0) or 0),
                   cp_size=int(getattr(config, "attn_cp_size", 1) or 1),
                   dcp_rank=int(getattr(config, "dcp_rank", 0) or 0),
                   dcp_size=int(getattr(config, "dcp_size", 1) or 1),
                   geometry=geometry, chunk_bytes=chunk_bytes)

    def namespace(self) -> bytes:
        if self.mla:  # replicated across TP (and DP) ranks: one copy for all
            ranks = (f"mla|pp{self.pp_rank}/{self.pp_size}|cp{self.cp_rank}/{self.cp_size}"
                     f"|dcp{self.dcp_rank}/{self.dcp_size}")
        else:
            ranks = (f"mha|tp{self.tp_rank}/{self.tp_size}|dp{self.dp_rank}|pp{self.pp_rank}/{self.pp_size}"
                     f"|cp{self.cp_rank}/{self.cp_size}")
        return "|".join([VERSION, self.block.identity(), ranks, self.geometry, str(self.chunk_bytes)]).encode()


def block_keys(namespace: bytes, page_hashes: Sequence[str], slots: Sequence[str]) -> list[bytes]:
    """The keys of every slot of every page, page-major: [page0.slot0, page0.slot1, ..., page1.slot0, ...]."""
    base = hashlib.blake2b(namespace + b"\x00", digest_size=16)
    encoded = [s.encode() for s in slots]
    out: list[bytes] = []
    for page in page_hashes:
        h = base.copy()
        h.update(str(page).encode() + b"\x00")
        for slot in encoded:
            k = h.copy()
            k.update(slot)
            out.append(k.digest())
    return out
