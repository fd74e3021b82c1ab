"""The CPU shim against tpu-inference's own code: its attention against the upstream reference
implementations (same outputs, same cache bytes), its KV copy against upstream's contract, and
its version pin and symbol checks."""

from __future__ import annotations

import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tpu_inference.kernels.ragged_paged_attention.v3 import kernel as rpa
from tpu_inference.kernels.ragged_paged_attention.v3 import kernel_hd64 as rpa_hd64

import tpusync_cpu_shim
from tpusync_cpu_shim import attention, copy

PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES, MAX_SEQS = 16, 8, 40, 4
# (q_len, kv_len): a decode, a prefill, a chunk of a longer prompt; a fourth slot stays empty.
SEQS = [(1, 40), (20, 20), (10, 50)]
DISTRIBUTION = [1, 1, 3]
TOKENS = 40  # padded batch: 31 real tokens


def _inputs(head_dim: int, get_shape, seed: int = 0, q_heads: int = 4, kv_heads: int = 2):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((TOKENS, q_heads, head_dim), np.float32)
    k = rng.standard_normal((TOKENS, kv_heads, head_dim), np.float32)
    v = rng.standard_normal((TOKENS, kv_heads, head_dim), np.float32)
    cache = rng.standard_normal(get_shape(NUM_PAGES, PAGE_SIZE, kv_heads, head_dim, jnp.float32), np.float32)
    pages = rng.permutation(NUM_PAGES)[:MAX_SEQS * PAGES_PER_SEQ].astype(np.int32)
    kv_lens = np.array([kv for _, kv in SEQS] + [0], np.int32)
    cu = np.concatenate([[0], np.cumsum([q for q, _ in SEQS])]).astype(np.int32)
    cu = np.concatenate([cu, [cu[-1]]]).astype(np.int32)
    return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cache), jnp.asarray(kv_lens),
            jnp.asarray(pages), jnp.asarray(cu), jnp.asarray(DISTRIBUTION, jnp.int32))


def _real_tokens() -> int:
    return sum(q for q, _ in SEQS)


def assert_equals_reference(got_out, got_cache, want_out, want_cache, head_dim: int) -> None:
    """The shim's attention output equals upstream's reference on the real tokens (the padding
    rows are undefined), and its updated cache bit for bit."""
    n = _real_tokens()
    assert got_out.shape == (TOKENS, 4, head_dim)
    np.testing.assert_allclose(np.asarray(got_out)[:n], np.asarray(want_out)[:n], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_attention_equals_upstream_reference(sliding_window):
    args = _inputs(128, rpa.get_kv_cache_shape)
    want_out, want_cache = rpa.ref_ragged_paged_attention(*args, sm_scale=0.1, sliding_window=sliding_window)
    got_out, got_cache = jax.jit(lambda *a: attention.ragged_paged_attention(
        *a, sm_scale=0.1, sliding_window=sliding_window))(*args)
    assert_equals_reference(got_out, got_cache, want_out, want_cache, head_dim=128)


def test_attention_hd64_equals_upstream_reference():
    args = _inputs(64, rpa_hd64.get_kv_cache_shape, seed=1)
    sink = jnp.asarray(np.random.default_rng(2).standard_normal(4, np.float32))
    for s in (None, sink):
        want_out, want_cache = rpa_hd64.ref_ragged_paged_attention_hd64(*args, s, sm_scale=0.125)
        got_out, got_cache = jax.jit(lambda *a: attention.ragged_paged_attention_hd64(*a, sm_scale=0.125))(*args, s)
        assert_equals_reference(got_out, got_cache, want_out, want_cache, head_dim=64)


def test_attention_without_cache_update_reads_the_cache_as_is():
    args = _inputs(128, rpa.get_kv_cache_shape, seed=3)
    _, cache = attention.ragged_paged_attention(*args, sm_scale=0.1, update_kv_cache=False)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(args[3]))


def test_multi_layer_copy_moves_the_named_chunks_of_every_layer():
    rng = np.random.default_rng(4)
    src = [rng.standard_normal((6, 4, 3), np.float32) for _ in range(3)]
    dest = [rng.standard_normal((12, 4, 3), np.float32) for _ in range(3)]
    want = [d.copy() for d in dest]
    chunks = [(0, 7, 2), (2, 1, 3)]  # (src offset, dest offset, rows): rows 0-1 -> 7-8, rows 2-4 -> 1-3
    for w, s in zip(want, src):
        for so, do, n in chunks:
            w[do:do + n] = s[so:so + n]
    # Padded as tpu-inference's insert_kv_chunks pads: unused chunk slots are zeros.
    offsets = np.array([c[0] for c in chunks] + [0] * 4, np.int32)
    dest_offsets = np.array([c[1] for c in chunks] + [0] * 4, np.int32)
    sizes = np.array([c[2] for c in chunks] + [0] * 4, np.int32)
    out = copy.multi_layer_copy(src_array=[jnp.asarray(s) for s in src], dest_array=[jnp.asarray(d) for d in dest],
                                src_offsets=jnp.asarray(offsets), dest_offsets=jnp.asarray(dest_offsets),
                                chunk_sizes=jnp.asarray(sizes), num_chunks=jnp.asarray([2], jnp.int32))
    for got, w in zip(out, want):
        np.testing.assert_array_equal(np.asarray(got), w)


def test_shim_is_registered_and_pinned():
    assert tpusync_cpu_shim.active()
    tpusync_cpu_shim.register()  # vLLM's plugin loader did this already in engine processes
    from tpu_inference.layers.common import attention_interface

    assert attention_interface.ragged_paged_attention is attention.ragged_paged_attention
    assert importlib.metadata.version("tpu_inference") == tpusync_cpu_shim.TPU_INFERENCE_VERSION


def test_shim_refuses_another_tpu_inference(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.33.0")
    with pytest.raises(tpusync_cpu_shim.ShimError, match=r"0\.33\.0"):
        tpusync_cpu_shim.check_version()


def test_shim_refuses_a_moved_symbol():
    with pytest.raises(tpusync_cpu_shim.ShimError, match="no_such_kernel"):
        tpusync_cpu_shim._patch("tpu_inference.layers.common.attention_interface", "no_such_kernel", None)
