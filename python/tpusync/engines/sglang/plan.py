"""How one page of an SGLang host pool maps onto store blocks.

`pool.get_page_buffer_meta(indices)` (sglang/srt/mem_cache/pool_host/mha.py and mla.py, 0.5.23)
gives, page after page, the (pointer, size) of each buffer holding the page:

    MHA layer_first              K(layer 0), V(layer 0), K(layer 1), V(layer 1), ...
    MHA page_first(_direct)/page_head   K, V (each one run of every layer)
    MLA layer_first              latent(layer 0), latent(layer 1), ...
    MLA page_first(_direct)      latent (one run)

A page becomes parts ("k" then "v" from the alternating buffers, or MLA's single "latent"), each
part the bytes of its buffers in order, cut into chunks of at most the store's block size.
Those bytes, part after part, are exactly the page's flat form in SGLang's generic path
(`pool.get_data_page(i, flat=True)`: K before V, layer-major as the pool holds them), so the
zero-copy v1 path and the generic path store the same blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    piece: int   # which of the page's buffers
    offset: int  # bytes into that buffer
    length: int


@dataclass(frozen=True)
class Chunk:
    slot: str                        # "k.0", "v.0", "latent.0", ...
    segments: tuple[Segment, ...]    # the buffer ranges it holds, in order
    nbytes: int
    flat_offset: int                 # where it starts in the page's flat form


class PagePlan:
    """The chunks of one page, the same for every page of a pool (only the pointers differ)."""

    def __init__(self, sizes: Sequence[int], *, mla: bool, chunk_bytes: int) -> None:
        if not sizes:
            raise ValueError("a page with no buffers")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self.sizes = tuple(int(s) for s in sizes)
        self.mla = mla
        self.chunk_bytes = chunk_bytes
        n = len(self.sizes)
        if mla:
            parts = [("latent", list(range(n)))]
        else:
            if n % 2:
                raise ValueError(f"an MHA page of {n} buffers: expected K, V pairs")
            parts = [("k", list(range(0, n, 2))), ("v", list(range(1, n, 2)))]
        chunks: list[Chunk] = []
        flat = 0
        for name, pieces in parts:
            index, segs, filled = 0, [], 0
            for piece in pieces:
                offset = 0
                while offset < self.sizes[piece]:
                    take = min(self.sizes[piece] - offset, chunk_bytes - filled)
                    segs.append(Segment(piece, offset, take))
                    offset += take
                    filled += take
                    if filled == chunk_bytes:
                        chunks.append(Chunk(f"{name}.{index}", tuple(segs), filled, flat))
                        flat += filled
                        index, segs, filled = index + 1, [], 0
            if segs:
                chunks.append(Chunk(f"{name}.{index}", tuple(segs), filled, flat))
                flat += filled
        self.chunks = tuple(chunks)
        self.slots = tuple(c.slot for c in chunks)
        self.page_bytes = flat
        self.direct = all(len(c.segments) == 1 for c in chunks)
        """Every chunk is one contiguous range of one buffer: stored and loaded in one batched
        call straight from the pool's memory (no gathering)."""

    @property
    def pieces(self) -> int:
        return len(self.sizes)

    def geometry(self) -> str:
        """Part sizes, for the key namespace: pools of other shapes never share blocks."""
        return f"{'mla' if self.mla else 'mha'}:{len(self.sizes)}x{'/'.join(str(s) for s in sorted(set(self.sizes)))}"
