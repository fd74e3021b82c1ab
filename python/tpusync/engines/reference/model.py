"""A small decoder-only transformer in JAX with a paged KV cache.

Deterministic random weights from a seed. The KV cache has the layout tpusync moves:
`k`, `v`: [layers, pages, page_size, kv_heads, head_dim]. Prompts are computed in chunks of
`chunk` tokens that start at multiples of `chunk`, with attention over a power-of-two prefix
of the cache; so the computation of a chunk does not depend on whether the KV before it was
computed here, loaded from host DRAM or disk, or pulled from a peer. Greedy decoding is then
bit-for-bit the same in monolithic, disaggregated and prefix-cached runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    d_model: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    mlp: int = 512
    page_size: int = 32
    chunk: int = 128  # prefill chunk, a multiple of page_size
    max_seq: int = 4096
    seed: int = 0
    dtype: str = "float32"

    @property
    def pages(self) -> int:
        return self.max_seq // self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V: one store block."""
        return 2 * self.layers * self.page_size * self.kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    def validate(self) -> None:
        if self.chunk % self.page_size or self.max_seq % self.chunk:
            raise ValueError("chunk must be a multiple of page_size, and max_seq a multiple of chunk")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")


def init_params(cfg: ModelConfig) -> dict[str, Any]:
    key = jax.random.PRNGKey(cfg.seed)
    dt = jnp.dtype(cfg.dtype)

    def w(k: jax.Array, shape: tuple[int, int]) -> jax.Array:
        out: jax.Array = (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])).astype(dt)
        return out

    keys = jax.random.split(key, 2 + cfg.layers)
    layers = []
    for i in range(cfg.layers):
        k = jax.random.split(keys[2 + i], 6)
        layers.append({
            "wq": w(k[0], (cfg.d_model, cfg.heads * cfg.head_dim)),
            "wk": w(k[1], (cfg.d_model, cfg.kv_heads * cfg.head_dim)),
            "wv": w(k[2], (cfg.d_model, cfg.kv_heads * cfg.head_dim)),
            "wo": w(k[3], (cfg.heads * cfg.head_dim, cfg.d_model)),
            "w1": w(k[4], (cfg.d_model, cfg.mlp)),
            "w2": w(k[5], (cfg.mlp, cfg.d_model)),
        })
    return {"embed": w(keys[0], (cfg.vocab, cfg.d_model)) * 4, "unembed": w(keys[1], (cfg.d_model, cfg.vocab)),
            "layers": layers}


def empty_cache(cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    shape = (cfg.layers, cfg.pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)
    return jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)


def _norm(x: jax.Array) -> jax.Array:
    # LayerNorm without gain: centring keeps random weights from favouring one token forever.
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _rope(x: jax.Array, pos: jax.Array, head_dim: int) -> jax.Array:
    half = head_dim // 2
    freq = 1.0 / (10000 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = pos[:, None].astype(jnp.float32) * freq[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


@partial(jax.jit, static_argnames=("cfg", "n", "span"), donate_argnums=(1, 2))
def forward(params: dict[str, Any], k_cache: jax.Array, v_cache: jax.Array, tokens: jax.Array, start: jax.Array | int,
            *, cfg: ModelConfig, n: int, span: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs `n` tokens at positions start..start+n-1, writing their K/V into the cache.

    Attention reads the first `span` cache positions (static, a power of two), masked causally.
    Returns (logits of the last of the n tokens [vocab] per position [n, vocab], k, v).
    """
    pos = start + jnp.arange(n)
    x = params["embed"][tokens]
    flat = (cfg.layers, cfg.pages * cfg.page_size, cfg.kv_heads, cfg.head_dim)
    kf, vf = k_cache.reshape(flat), v_cache.reshape(flat)
    group = cfg.heads // cfg.kv_heads
    key_pos = jnp.arange(span)
    mask = key_pos[None, :] <= pos[:, None]
    for i, lp in enumerate(params["layers"]):
        h = _norm(x)
        q = _rope((h @ lp["wq"]).reshape(n, cfg.heads, cfg.head_dim), pos, cfg.head_dim)
        k = _rope((h @ lp["wk"]).reshape(n, cfg.kv_heads, cfg.head_dim), pos, cfg.head_dim)
        v = (h @ lp["wv"]).reshape(n, cfg.kv_heads, cfg.head_dim)
        kf = jax.lax.dynamic_update_slice(kf, k[None], (i, start, 0, 0))
        vf = jax.lax.dynamic_update_slice(vf, v[None], (i, start, 0, 0))
        keys = jnp.repeat(kf[i, :span], group, axis=1)  # [span, heads, dim]
        vals = jnp.repeat(vf[i, :span], group, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, keys) / np.sqrt(cfg.head_dim)
        scores = jnp.where(mask[None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        att = jnp.einsum("hqk,khd->qhd", probs, vals).reshape(n, cfg.heads * cfg.head_dim)
        x = x + att @ lp["wo"]
        x = x + jnp.tanh(_norm(x) @ lp["w1"]) @ lp["w2"]
    logits = _norm(x) @ params["unembed"]
    shape = (cfg.layers, cfg.pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)
    return logits, kf.reshape(shape), vf.reshape(shape)


def span_for(cfg: ModelConfig, end: int) -> int:
    """The attention span for positions < end: the next power of two, at least one chunk."""
    span = cfg.chunk
    while span < end:
        span *= 2
    return min(span, cfg.max_seq)
