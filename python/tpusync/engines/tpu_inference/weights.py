"""A running tpu-inference engine's weights updated in place from tpusync.

    LLM(..., worker_extension_cls="tpusync.engines.tpu_inference.weights.WeightUpdate")
    llm.start_weight_update()    # tpu-inference's TPUWorker frees the KV cache for the update
    llm.collective_rpc("tpusync_update_weights", kwargs={"model": "policy", "version": 7,
                       "control_socket": "/run/tpusync/control.sock"})
    llm.finish_weight_update()   # ... and allocates it again
    llm.reset_prefix_cache()     # vLLM's prefix cache holds KV of the old weights

tpu-inference 0.32's own weight path binds upstream TPU Sync, which DMAs into the device
buffers and runs only on TPU; its `update_weights` expects the weights to arrive out of
band. This extension is that band: the newest committed version >= `version` on the
worker's host, pinned, is fed to the model's own `load_weights` (HF names, torch tensors,
the same iterator tpu-inference loads checkpoints from; it lays each weight out and shards
it onto the engine's mesh), read off the host's pool one leaf at a time; then the
runner's flat weight leaves, which every jitted step takes as its first argument, are
refreshed, or the engine would keep serving the arrays it had. A version that does not
arrive in time fails the call with the engine untouched.

The contract is tpu-inference 0.32.0's (tests/tpu_inference/requirements.txt):
tpu_inference/worker/tpu_worker.py (start_weight_update frees the KV cache, finish_weight_update
reallocates it, update_weights expects the weights out of band), runner/tpu_runner.py
(refresh_state_leaves), models/jax/utils/weight_utils.py (LoadableWithIterator.load_weights).
tests/tpu_inference/test_weight_update.py runs it in a real engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from tpusync import errors
from tpusync.store import connect_sidecar
from tpusync.weights.inplace import await_version, iter_torch, pinned_version


class WeightUpdate:
    """A worker extension (vLLM's worker_extension_cls), mixed into tpu-inference's TPUWorker."""

    model_runner: Any
    vllm_config: Any

    def tpusync_update_weights(self, model: str, version: int | None = None, control_socket: str | None = None,
                               timeout_s: float = 300.0, verify: bool = False,
                               secret_file: str | None = None) -> int:
        """Loads the newest version >= `version` of `model` from this host's sidecar into the
        engine's weights; returns the version loaded."""
        try:
            return self._tpusync_update(self._tpusync_sidecar(control_socket, secret_file), model, version,
                                        timeout_s, verify)
        except errors.UnavailableError:
            # The connection kept from an earlier update is gone (the sidecar restarted): once
            # more on a new one.
            self._tpusync_forget()
            return self._tpusync_update(self._tpusync_sidecar(control_socket, secret_file), model, version,
                                        timeout_s, verify)

    def _tpusync_update(self, store: Any, model: str, version: int | None, timeout_s: float, verify: bool) -> int:
        loaded = await_version(store, model, version, timeout_s)
        with pinned_version(store, model, loaded) as manifest:
            # Copies: tpu-inference may wrap a CPU tensor as a JAX array without one (DLPack),
            # and the engine's weights must not live in pool slots that are evicted later.
            load_in_place(self.model_runner, self.vllm_config,
                          iter_torch(store, manifest, verify=verify, zero_copy=False))
        return loaded

    # One connection to the sidecar, kept from update to update: its mapping of the pool is
    # then warm (a new one would fault in every page of every version it reads).
    _tpusync_store: Any = None
    _tpusync_target: tuple[str | None, str | None] | None = None

    def _tpusync_sidecar(self, control_socket: str | None, secret_file: str | None) -> Any:
        if self._tpusync_store is None or self._tpusync_target != (control_socket, secret_file):
            self._tpusync_forget()
            self._tpusync_store = connect_sidecar(control_socket, secret_file=secret_file)
            self._tpusync_target = (control_socket, secret_file)
        return self._tpusync_store

    def _tpusync_forget(self) -> None:
        if self._tpusync_store is not None:
            with contextlib.suppress(errors.TpuSyncError, OSError):  # a sidecar gone already
                self._tpusync_store.close()
        self._tpusync_store = self._tpusync_target = None


def load_in_place(runner: Any, vllm_config: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """The engine's own in-place load of (HF name, torch tensor) pairs: its model's `load_weights`
    on the runner's mesh, then the runner's state refreshed. Whatever feeds it (the pool, or
    tensors already in memory: the floor bench/inplace_bench.py measures) pays the same."""
    import jax
    from vllm.config import set_current_vllm_config

    if not hasattr(runner.model, "load_weights"):
        raise errors.InvalidArgumentError(f"{type(runner.model).__name__} cannot load weights from an iterator")
    with jax.set_mesh(runner.mesh), set_current_vllm_config(vllm_config):
        runner.model.load_weights(weights)
    runner.refresh_state_leaves()
