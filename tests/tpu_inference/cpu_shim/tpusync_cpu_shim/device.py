"""Device identity, memory and mesh for tpu-inference on the JAX CPU backend."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_optimized_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], *, devices=None) -> Mesh:
    """Stands in for `tpu_inference.utils.make_optimized_mesh`, which sorts devices by their TPU
    `coords` (CPU devices have none): the devices in id order, axes as asked."""
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: d.id)
    return Mesh(np.array(devices).reshape(axis_shapes), tuple(axis_names),
                axis_types=(AxisType.Auto,) * len(axis_shapes))


# What the CPU device reports as its "HBM": vLLM sizes the KV cache as a share of it (the
# tests pin the number of KV blocks with num_gpu_blocks_override instead).
CPU_HBM_BYTES = 2 << 30


def get_device_hbm_limit() -> int:
    """Stands in for `tpu_inference.utils.get_device_hbm_limit`, a table of TPU generations."""
    return CPU_HBM_BYTES


def get_device_name(cls, device_id: int = 0) -> str:
    """Stands in for `TpuPlatform.get_device_name`, which asks tpu_info for the local TPU chips."""
    return f"CPU ({jax.devices()[device_id].device_kind}) via tpusync_cpu_shim"


def bindable(arr) -> bool:
    """Stands in for `tpu_inference.rl.raiden_worker_sync._bindable`, which binds floating-point
    arrays of rank >= 1 on TPU devices only: the same, on CPU devices."""
    import jax.numpy as jnp

    try:
        return (arr.ndim >= 1 and bool(jnp.issubdtype(arr.dtype, jnp.floating)) and bool(arr.devices())
                and all(d.platform in ("tpu", "cpu") for d in arr.devices()))
    except Exception:  # noqa: BLE001 - upstream's answer for anything it cannot inspect
        return False
