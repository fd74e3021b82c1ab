"""tpu-inference's multi-layer KV chunk copy, in plain JAX for the CPU backend.

Upstream (`tpu_inference/distributed/kv_transfer.py`, `multi_layer_copy`) starts Pallas TPU DMAs:
for every layer, rows `src[src_offsets[i] : +chunk_sizes[i]]` go to
`dest[dest_offsets[i] : +chunk_sizes[i]]` along axis 0, for the first `num_chunks` chunks. Same
arguments, same result, one gather per layer; the destinations are donated as upstream's are.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


@partial(jax.jit, donate_argnums=(1,))
def _copy(src_array, dest_array, src_offsets, dest_offsets, chunk_sizes, num_chunks):
    rows = dest_array[0].shape[0]
    r = jnp.arange(rows, dtype=jnp.int32)
    live = jnp.arange(chunk_sizes.shape[0]) < num_chunks
    ends = dest_offsets + chunk_sizes
    inside = live[:, None] & (r[None, :] >= dest_offsets[:, None]) & (r[None, :] < ends[:, None])
    covered = jnp.any(inside, axis=0)
    chunk = jnp.argmax(inside, axis=0)  # the chunk that writes each destination row
    source = src_offsets[chunk] + r - dest_offsets[chunk]
    out = []
    for src, dest in zip(src_array, dest_array):
        picked = src[jnp.clip(source, 0, src.shape[0] - 1)]
        keep = covered.reshape((rows,) + (1,) * (dest.ndim - 1))
        out.append(jnp.where(keep, picked.astype(dest.dtype), dest))
    return out


def multi_layer_copy(*, src_array, dest_array, src_offsets, dest_offsets, chunk_sizes, num_chunks=None, mesh=None,
                     src_sharding_spec=None, dest_sharding_spec=None, replicated_sharding_spec=None):
    """Stands in for `kv_transfer.multi_layer_copy` (same keyword arguments; the mesh and sharding
    specs only steer upstream's per-shard kernels)."""
    n = chunk_sizes.shape[0] if num_chunks is None else jnp.asarray(num_chunks).reshape(-1)[0]
    return _copy(list(src_array), list(dest_array), src_offsets, dest_offsets, chunk_sizes, n)
