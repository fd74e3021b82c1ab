"""Test support: run tpu-inference on the JAX CPU backend. Not part of tpusync.

A vLLM general plugin (entry point `vllm.general_plugins`, loaded by vLLM in every process
before the engine starts). With `JAX_PLATFORMS=cpu`, tpu-inference 0.32.0 still selects its
TPU platform and stops at a few TPU-only points; this replaces exactly those, keeping
tpu-inference's KV cache layout so that KV connectors see what they would see on a TPU:

- the device mesh: `utils.make_optimized_mesh` sorts devices by their TPU `coords` (CPU
  devices have none): here the devices in id order;
- the HBM size (`utils.get_device_hbm_limit`, a table keyed by TPU generation) and the device
  name (`TpuPlatform.get_device_name`, through tpu_info);
- the XLA TPU compiler options (`xla_tpu_*` flags the CPU compiler rejects): none;
- the ragged paged-attention Pallas kernels (`attention.py`: plain JAX, same cache layout);
- the Pallas multi-layer KV copy used by tpu-inference's connectors (`copy.py`);
- which weights the RL sampler binds (`rl.raiden_worker_sync._bindable` keeps arrays on TPU
  devices only): arrays on CPU devices too, by the same rules otherwise.

It is pinned to the exact tpu-inference release it patches and fails loudly when the version
differs or a patched symbol is missing, rather than letting an engine run half-patched. It
does nothing unless JAX is restricted to the CPU (`JAX_PLATFORMS=cpu`): detecting the backend
by initialising JAX would claim the TPU in every vLLM process on a real TPU host.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
from typing import Any

TPU_INFERENCE_VERSION = "0.32.0"

log = logging.getLogger("tpusync_cpu_shim")
PATCHED: dict[tuple[str, str], Any] = {}   # (module, attribute) -> the upstream object it replaced


class ShimError(RuntimeError):
    """The installed tpu-inference is not the one this shim was written against."""


# Modules that read the compiler options (tpu-inference 0.32.0): they must import after the patch.
_OPTION_USERS = ("tpu_inference.layers.jax.sample.sampling", "tpu_inference.runner.decode_loop",
                 "tpu_inference.models.common.model_loader", "tpu_inference.models.vllm.vllm_model_wrapper")


def active() -> bool:
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    return platforms == ["cpu"]


def _patch(target: str, attr: str, new: Any) -> None:
    """Replaces `attr` of module `target` (or of class "module:Class"), remembering the original."""
    module_name, _, class_name = target.partition(":")
    owner = importlib.import_module(module_name)
    if class_name:
        owner = getattr(owner, class_name, None)
    if owner is None or not hasattr(owner, attr):
        raise ShimError(f"tpu-inference {TPU_INFERENCE_VERSION}: {target}.{attr} is gone; "
                        "update tests/tpu_inference/cpu_shim for this release")
    PATCHED.setdefault((target, attr), getattr(owner, attr))
    setattr(owner, attr, new)


def check_version() -> None:
    found = importlib.metadata.version("tpu_inference")
    if found != TPU_INFERENCE_VERSION:
        raise ShimError(f"tpusync_cpu_shim patches tpu-inference {TPU_INFERENCE_VERSION}, found {found}: "
                        "re-check every patched point against that release and update the pin")


def register() -> None:
    """vLLM calls this in every process (engine core, workers, API server)."""
    if not active() or PATCHED:
        return
    check_version()
    # XLA TPU compiler options (`xla_tpu_*`; the CPU compiler rejects them). First: modules import
    # these by name, and sampling.py calls one in a decorator at import time.
    early = [m for m in _OPTION_USERS if m in sys.modules]
    if early:
        raise ShimError(f"{early} imported before the shim: their XLA TPU compiler options are fixed already")
    for name in ("get_step_fn_compiler_options", "get_sampling_compiler_options"):
        _patch("tpu_inference.models.common.compiler_options", name, dict)

    from tpusync_cpu_shim import attention, copy, device

    # The device mesh: upstream sorts devices by TPU coords (tpu_runner imports it by name).
    _patch("tpu_inference.utils", "make_optimized_mesh", device.make_optimized_mesh)
    _patch("tpu_inference.runner.tpu_runner", "make_optimized_mesh", device.make_optimized_mesh)
    # The HBM size (a table of TPU generations keyed by device kind) and the device name (tpu_info).
    _patch("tpu_inference.utils", "get_device_hbm_limit", device.get_device_hbm_limit)
    _patch("tpu_inference.platforms.tpu_platform:TpuPlatform", "get_device_name",
           classmethod(device.get_device_name))

    # The Pallas attention kernels, where the attention layer looks them up at call time.
    _patch("tpu_inference.layers.common.attention_interface", "ragged_paged_attention",
           attention.ragged_paged_attention)
    _patch("tpu_inference.layers.common.attention_interface", "ragged_paged_attention_hd64",
           attention.ragged_paged_attention_hd64)
    # The Pallas multi-layer KV copy (tpu-inference's TPUConnector imports it by name).
    _patch("tpu_inference.distributed.kv_transfer", "multi_layer_copy", copy.multi_layer_copy)
    _patch("tpu_inference.distributed.tpu_connector", "multi_layer_copy", copy.multi_layer_copy)
    # The RL sampler's weight binding. Its module imports upstream TPU Sync's weight synchronizer
    # at import time: tpusync's aliases for it (TPUSYNC_UPSTREAM_API=1) must be in place first,
    # whichever plugin vLLM loads first.
    from tpusync.engines import upstream

    upstream.install_if_enabled()
    _patch("tpu_inference.rl.raiden_worker_sync", "_bindable", device.bindable)
    log.warning("tpusync_cpu_shim: tpu-inference %s runs on the JAX CPU backend (%d points replaced)",
                TPU_INFERENCE_VERSION, len(PATCHED))
