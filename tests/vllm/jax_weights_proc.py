"""The JAX end of tests/vllm/test_torch_weights.py, run by the main .venv's interpreter (JAX, no torch).

    python jax_weights_proc.py publish SOCKET MODEL VERSION OUT_DIR   a JAX pytree, its leaves' bytes to OUT_DIR
    python jax_weights_proc.py receive SOCKET MODEL VERSION OUT_DIR   into a JAX template, bytes to OUT_DIR
    python jax_weights_proc.py checkpoint SOCKET MODEL VERSION NPZ   a checkpoint's tensors (HF names), as
                                                                     jax.Arrays: a JAX trainer feeding vLLM

Each leaf's raw bytes are written to OUT_DIR/<name>.bin for the torch side to compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tpusync import KVStore, VersionedWeights

SHAPES = {"w": ((96, 40), jnp.bfloat16), "b": ((40,), jnp.float32), "steps": ((3,), jnp.int32)}


def main() -> int:
    op, socket, model, version, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5])
    sync = VersionedWeights(KVStore.connect(f"unix://{socket}"), model)
    if op == "checkpoint":
        with np.load(out) as npz:
            sync.publish({name: jnp.asarray(npz[name]) for name in npz.files}, version)
        sync.close()
        return 0
    if op == "publish":
        keys = jax.random.split(jax.random.key(version), len(SHAPES))
        params = {name: (jax.random.normal(k, shape, dtype) if jnp.issubdtype(dtype, jnp.floating)
                         else jnp.arange(np.prod(shape), dtype=dtype).reshape(shape))
                  for k, (name, (shape, dtype)) in zip(keys, SHAPES.items())}
        sync.publish(params, version)
    else:
        sync.bind_weights({name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in SHAPES.items()})
        sync.wait_for_version(version, timeout=60)
        params = sync.params
    for name, arr in params.items():
        (out / f"{name}.bin").write_bytes(np.asarray(arr).tobytes())
    sync.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
