"""Ragged paged attention in plain JAX, for the CPU backend, on tpu-inference's KV cache layout.

tpu-inference 0.32.0 runs attention through Pallas TPU kernels
(`kernels/ragged_paged_attention/v3/kernel.py` and `kernel_hd64.py` for head_dim 64). It ships
reference implementations beside them (`ref_ragged_paged_attention`,
`ref_ragged_paged_attention_hd64`), but those loop in Python over `distribution[-1]`, so they
only run eagerly, not inside the model's jit. This is the same computation written with static
shapes: every token is written into its page (with the kernels' own `merge_kv`, so the cache
layout is exactly theirs), then attends over its sequence's pages. `tests/tpu_inference/
test_cpu_shim.py` checks it against the upstream references.

Cost: scores for every (token, sequence, cache slot); fine for the tiny test models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from tpu_inference.kernels.ragged_paged_attention.v3 import kernel as rpa
from tpu_inference.kernels.ragged_paged_attention.v3 import kernel_hd64 as rpa_hd64


def _unpack_v3(pages: jax.Array, num_kv_heads: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """[..., X, packing, D] (rows k0, v0, k1, v1, ... padded) -> k, v [..., heads, head_dim]."""
    *lead, x, packing, d = pages.shape
    rows = pages.reshape(*lead, x * packing, d)[..., :2 * num_kv_heads, :]
    rows = rows.reshape(*lead, num_kv_heads, 2, d)
    return rows[..., 0, :head_dim], rows[..., 1, :head_dim]


def _unpack_hd64(pages: jax.Array, num_kv_heads: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """[..., X, packing, 128] (one row per head: k then v, 64 each) -> k, v [..., heads, 64]."""
    *lead, x, packing, d = pages.shape
    rows = pages.reshape(*lead, x * packing, d)[..., :num_kv_heads, :]
    return rows[..., :head_dim], rows[..., head_dim:2 * head_dim]


def _attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, sink, *,
               merge, unpack, use_causal_mask, update_kv_cache, sm_scale, sliding_window, soft_cap,
               q_scale, k_scale, v_scale, out_dtype):
    num_tokens, num_q_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    num_pages, page_size = kv_cache.shape[:2]
    max_seqs = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // max_seqs
    num_seqs = distribution[2]

    # Each token's sequence and position in it (tokens past the last sequence are padding).
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_ids = jnp.arange(max_seqs, dtype=jnp.int32)
    ends = jnp.where(seq_ids < num_seqs, cu_q_lens[1:max_seqs + 1], jnp.iinfo(jnp.int32).max)
    seq = jnp.sum(t[:, None] >= ends[None, :], axis=1).astype(jnp.int32)
    valid = seq < num_seqs
    seq = jnp.minimum(seq, max_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    pos = jnp.where(valid, pos, 0)

    if update_kv_cache:
        page = page_indices[seq * pages_per_seq + pos // page_size]
        page = jnp.where(valid, page, num_pages)  # out of bounds: dropped
        kv_cache = kv_cache.at[page, pos % page_size].set(merge(keys, values).astype(kv_cache.dtype), mode="drop")

    # Every sequence's pages, [seqs, slots, heads, head_dim], heads repeated for grouped queries.
    pages = kv_cache[page_indices.reshape(max_seqs, pages_per_seq)]
    pages = pages.reshape(max_seqs, pages_per_seq * page_size, *kv_cache.shape[2:])
    k, v = unpack(pages, num_kv_heads, head_dim)
    group = num_q_heads // num_kv_heads
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)

    q = queries
    if q_scale is not None:
        q = q / q_scale
    logits = jnp.einsum("thd,slhd->thsl", q.astype(k.dtype), k, preferred_element_type=jnp.float32)
    logits = logits * sm_scale
    if k_scale is not None:
        logits = logits * k_scale
    if q_scale is not None:
        logits = logits * q_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    slot = jnp.arange(pages_per_seq * page_size, dtype=jnp.int32)
    mask = (seq[:, None] == seq_ids[None, :])[:, :, None] & (slot[None, None, :] < kv_lens[None, :, None])
    if use_causal_mask:
        mask = mask & (slot[None, None, :] <= pos[:, None, None])
        if sliding_window is not None:
            mask = mask & (slot[None, None, :] > pos[:, None, None] - sliding_window)
    mask = mask & valid[:, None, None]
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    flat = logits.reshape(num_tokens, num_q_heads, -1)
    if sink is not None:  # one extra logit per query head, in the softmax only
        flat = jnp.concatenate([flat, jnp.broadcast_to(sink.astype(flat.dtype)[None, :, None],
                                                       (num_tokens, num_q_heads, 1))], axis=-1)
    peak = jnp.max(flat, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(flat - peak)
    weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)
    if sink is not None:
        weights = weights[..., :-1]
    weights = weights.reshape(logits.shape).astype(v.dtype)
    out = jnp.einsum("thsl,slhd->thd", weights, v, preferred_element_type=jnp.float32)
    if v_scale is not None:
        out = out * v_scale
    return out.astype(out_dtype), kv_cache


def ragged_paged_attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *,
                           use_causal_mask=True, update_kv_cache=True, sm_scale=1.0, sliding_window=None,
                           soft_cap=None, out_dtype=None, q_scale=None, k_scale=None, v_scale=None, **_tuning):
    """Stands in for `v3.kernel.ragged_paged_attention` (same arguments; tuning ones ignored)."""
    return _attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, None,
                      merge=rpa.merge_kv, unpack=_unpack_v3, use_causal_mask=use_causal_mask,
                      update_kv_cache=update_kv_cache, sm_scale=sm_scale, sliding_window=sliding_window,
                      soft_cap=soft_cap, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                      out_dtype=out_dtype or queries.dtype)


def ragged_paged_attention_hd64(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                                attention_sink=None, *, sm_scale=1.0, sliding_window=None, soft_cap=None,
                                q_scale=None, k_scale=None, v_scale=None, **_tuning):
    """Stands in for `v3.kernel_hd64.ragged_paged_attention_hd64` (head_dim 64)."""
    return _attention(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
                      attention_sink, merge=rpa_hd64.merge_kv, unpack=_unpack_hd64, use_causal_mask=True,
                      update_kv_cache=True, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                      q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out_dtype=queries.dtype)

