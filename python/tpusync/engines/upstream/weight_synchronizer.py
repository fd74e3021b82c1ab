"""`tpu_sync.api.jax.weight_synchronizer`: upstream's WeightSynchronizer, a sampler's live weights
bound for in-place updates, on tpusync.

Upstream (google/tpu-sync caeb0bfb..8acb2ef, tpu_sync/api/jax/weight_synchronizer.py) binds a
list of jax.Arrays and writes received weights into their device buffers in place; a trainer
pushes the slices to it. tpu-inference 0.32.0's RL sampler (tpu_inference/rl/
raiden_worker_sync.py) binds the engine's live nnx.Param arrays, in tree order, and calls
`h2d()` (or `wait_for_transfer_completion(uuid)` where the synchronizer has it) between
rollouts; the engine then serves the new weights without a restart.

Here the weights travel as tpusync versions: a trainer publishes the same list of arrays,
in the same order, with `tpusync.weights.VersionedWeights(store, model).publish(arrays,
version)` and the versions reach the sampler's host through its sidecar (`push_weights`, a
WeightDistributor, or a trainer on the same host). `h2d()` copies the newest version
committed on this host into the bound arrays' buffers in place, so every holder of those
arrays (the engine's model state) sees it. `model` is the published model's name ($TPUSYNC_
WEIGHTS_MODEL, by default "rollout", tpu-inference's job name); the sidecar comes from
$TPUSYNC_CONTROL_SOCKET.

In-place writes reach the buffers of arrays on the CPU backend (their memory is this
process's); on accelerators JAX offers no write into an existing device buffer, which
upstream does in C++ through PJRT: `h2d()` refuses those arrays, saying so. Leave such
engines to tpusync's own in-place path (tpusync.engines.tpu_inference.weights), which loads through
the model's load_weights and refreshes the runner's state.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

import numpy as np

from tpusync import errors
from tpusync.store import connect_sidecar
from tpusync.weights import VersionedWeights as _Versions
from tpusync.weights.keys import check_version
from tpusync.weights.tensors import iter_leaves

__all__ = ["WeightSynchronizer"]

MODEL_ENV = "TPUSYNC_WEIGHTS_MODEL"
DEFAULT_MODEL = "rollout"


def _template(arr: Any) -> np.ndarray:
    """A stand-in with the array's shape and dtype and no memory of its own."""
    return np.broadcast_to(np.zeros((), dtype=np.dtype(arr.dtype)), tuple(arr.shape))


def _write_in_place(arr: Any, host: np.ndarray) -> None:
    """Copies `host` (the whole array) into each of the array's local buffers."""
    for shard in arr.addressable_shards:
        data = shard.data
        if data.devices().pop().platform != "cpu":
            raise NotImplementedError(
                f"h2d into {data.devices().pop().platform} buffers: JAX cannot write into an existing device "
                "buffer (upstream does it in C++ through PJRT); use tpusync.engines.tpu_inference.weights' in-place "
                "update")
        data.block_until_ready()  # nothing may still be reading or writing it
        src = np.ascontiguousarray(host[shard.index], dtype=np.dtype(data.dtype))
        buf = (ctypes.c_char * src.nbytes).from_address(data.unsafe_buffer_pointer())
        np.frombuffer(memoryview(buf), dtype=src.dtype).reshape(src.shape)[...] = src


class WeightSynchronizer:
    def __init__(self, jax_arrays: list[Any], local_port: int | None = None, parallelism: int = 1,
                 unsafe_skip_buffer_lock: bool = False, listener_port: int | None = None,
                 bind_ip: str | None = None, auto_h2d: bool = False, *, model: str | None = None,
                 control_socket: str | None = None) -> None:
        self.model = model or os.environ.get(MODEL_ENV) or DEFAULT_MODEL
        self._versions = _Versions(connect_sidecar(control_socket), self.model)
        self._local_port, self._listener_port = local_port, listener_port
        self._lock = threading.Lock()
        self._version: int | None = None
        self._arrays: list[Any] = []
        self._names: list[str] = []
        self._metrics: dict[str, Any] = {"h2d_call_count": 0, "total_h2d_bytes": 0, "last_h2d_time_ms": 0.0,
                                         "total_h2d_time_ms": 0.0, "version": None}
        self._bind(list(jax_arrays), first=True)

    def _bind(self, arrays: list[Any], first: bool) -> None:
        if not first:
            old = [(tuple(a.shape), np.dtype(a.dtype), len(a.addressable_shards)) for a in self._arrays]
            new = [(tuple(a.shape), np.dtype(a.dtype), len(a.addressable_shards)) for a in arrays]
            if old != new:
                raise RuntimeError(f"Bind weights failed: {len(new)} arrays do not match the {len(old)} bound "
                                   "(count, shapes, dtypes and shards must stay)")
        templates = [_template(a) for a in arrays]
        self._arrays, self._names = arrays, [name for name, _ in iter_leaves(templates)]
        self._versions.bind_weights(templates)

    def bind_weights(self, jax_arrays: list[Any]) -> None:
        """Rebinds to new array objects of the same count, shapes and shards."""
        with self._lock:
            self._bind(list(jax_arrays), first=False)

    def h2d(self) -> None:
        """Writes the newest version committed on this host into the bound arrays, in place."""
        version = self._versions.latest_version()
        if version is None:
            raise RuntimeError(f"Weight sync H2D failed: no version of {self.model!r} is committed on this host")
        self._land(version)

    def wait_for_transfer_completion(self, uuid: int | None = None, timeout: float | None = None) -> None:
        """Waits until version `uuid` (or, with None, any version newer than the one bound) is
        committed on this host, then h2d(). A tpusync addition: tpu-inference's sampler calls it
        where present instead of polling the arrays until they stop changing."""
        want = check_version(uuid, "uuid") if uuid is not None else (self._version or 0) + 1
        with self._lock:
            self._versions.wait_for_version(want, timeout)
        self.h2d()

    def _land(self, version: int) -> None:
        with self._lock:
            start = time.perf_counter()
            try:
                self._versions.load(version)
            except errors.TpuSyncError as e:
                raise RuntimeError(f"Weight sync H2D failed: {e}") from e
            host = self._versions.get_host_buffer()
            nbytes = 0
            for name, arr in zip(self._names, self._arrays):
                _write_in_place(arr, host[name])
                nbytes += arr.nbytes
            ms = (time.perf_counter() - start) * 1e3
            self._version = version
            m = self._metrics
            m.update(h2d_call_count=m["h2d_call_count"] + 1, total_h2d_bytes=m["total_h2d_bytes"] + nbytes,
                     last_h2d_time_ms=ms, total_h2d_time_ms=m["total_h2d_time_ms"] + ms, version=version)

    def d2h(self) -> None:
        raise NotImplementedError("a sampler's WeightSynchronizer receives; a trainer publishes with "
                                  "tpusync.weights.VersionedWeights(store, model).publish(arrays, version)")

    @property
    def local_port(self) -> int | None:
        return self._local_port

    @property
    def listener_port(self) -> int | None:
        return self._listener_port

    @property
    def is_listener_active(self) -> bool:
        return False  # versions arrive through the sidecar, not a listener of this process

    @property
    def num_layers(self) -> int:
        return len(self._arrays)

    @property
    def num_shards(self) -> int:
        return len(self._arrays[0].addressable_shards) if self._arrays else 0

    def get_metrics(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._metrics)

    def reset_metrics(self) -> None:
        with self._lock:
            self._metrics.update(h2d_call_count=0, total_h2d_bytes=0, last_h2d_time_ms=0.0, total_h2d_time_ms=0.0)

    def close(self) -> None:
        self._versions.close()
