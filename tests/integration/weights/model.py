"""The test model: a pytree with bfloat16, float32 and int8 leaves, deterministic per seed."""

from __future__ import annotations

import hashlib

import numpy as np


def host_params(seed: int) -> dict:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((1024, 1024)).astype(ml_dtypes.bfloat16),   # 2 MiB: 8 blocks
        "layers": [{"w": rng.standard_normal((512, 512)).astype(np.float32),      # 1 MiB: 4 blocks
                    "n": rng.integers(-128, 127, 999, dtype=np.int8)} for _ in range(2)],
        "head": rng.standard_normal((300, 700)).astype(ml_dtypes.bfloat16),     # 410 KiB: 2 blocks, short tail
    }


def params(seed: int) -> dict:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.asarray, host_params(seed))


def digest(tree) -> str:
    import jax

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf)
        h.update(f"{a.dtype.name}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()
