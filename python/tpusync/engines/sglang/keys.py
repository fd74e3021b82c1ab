"""Block keys of SGLang HiCache pages in a tpusync store.

SGLang names a page by a hash string of its tokens and the pages before it (the same on every
rank: sglang/srt/mem_cache/hicache_storage.py, HiCacheStorage.batch_exists gets the same keys
on every TP rank). One page of a rank's host pool holds that rank's share of the page (its KV
heads, its layers), so a block key binds the page hash to everything that changes the bytes:

    namespace = "tpusync-sglang/1" | model | ranks | layout | geometry | chunk bytes
    key       = BLAKE2b-128(namespace | page hash | slot)     # 16 bytes, big-endian as the store reads it

`ranks` is tp_rank/tp_size, dp_rank, pp_rank/pp_size and attn_cp_rank/size for MHA models; an
MLA model's latent is the same on every TP rank (SGLang writes it from one rank only:
HiCacheStorageConfig.is_storage_writer), so its keys leave TP and DP out and every rank reads
the one copy (the DCP shard stays in). `slot` names the part of the page ("k", "v", or MLA's
"latent") and the chunk of it ("k.0", "k.1", ... when a part exceeds a store block).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

VERSION = "tpusync-sglang/1"


@dataclass(frozen=True)
class KeyScope:
    """What, besides the page hash, makes a page's bytes differ."""

    model: str
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
    layout: str = ""
    geometry: str = ""
    chunk_bytes: int = 0

    @classmethod
    def from_config(cls, config: Any, *, model: str | None, layout: str, geometry: str,
                    chunk_bytes: int) -> KeyScope:
        """From SGLang's HiCacheStorageConfig (read by attribute: no SGLang import here)."""
        return cls(model=model if model is not None else (config.model_name or ""),
                   mla=bool(config.is_mla_model),
                   tp_rank=int(config.tp_rank), tp_size=int(config.tp_size),
                   dp_rank=int(getattr(config, "dp_rank", 0) or 0),
                   pp_rank=int(config.pp_rank), pp_size=int(config.pp_size),
                   cp_rank=int(getattr(config, "attn_cp_rank", 0) or 0),
                   cp_size=int(getattr(config, "attn_cp_size", 1) or 1),
                   dcp_rank=int(getattr(config, "dcp_rank", 0) or 0),
                   dcp_size=int(getattr(config, "dcp_size", 1) or 1),
                   layout=layout, geometry=geometry, chunk_bytes=chunk_bytes)

    def namespace(self) -> bytes:
        if self.mla:  # replicated across TP (and DP) ranks: one copy for all
            ranks = (f"mla|pp{self.pp_rank}/{self.pp_size}|cp{self.cp_rank}/{self.cp_size}"
                     f"|dcp{self.dcp_rank}/{self.dcp_size}")
        else:
            ranks = (f"mha|tp{self.tp_rank}/{self.tp_size}|dp{self.dp_rank}|pp{self.pp_rank}/{self.pp_size}"
                     f"|cp{self.cp_rank}/{self.cp_size}")
        return "|".join([VERSION, self.model, ranks, self.layout, self.geometry, str(self.chunk_bytes)]).encode()


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
