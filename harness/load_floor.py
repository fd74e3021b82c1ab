"""The floor of an in-place weight update: an engine's own load of weights already in its memory.

Worker extensions (vLLM's worker_extension_cls) for bench/inplace_bench.py. `tpusync_stage_floor`
reads a checkpoint's tensors into the worker's memory (untimed); `tpusync_load_floor` then feeds
them to the engine's own in-place load, the same function tpusync's update feeds from the pool
(tpusync.engines.vllm.weight_transfer.load_in_place, tpusync.engines.tpu_inference.weights.
load_in_place), and returns its seconds. An update can take no less than that plus the link's
time for the bytes. The engine scripts run from this directory: vLLM imports these classes as
`load_floor.<class>`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tpusync.engines.tpu_inference.weights import WeightUpdate


def checkpoint_tensors(checkpoint: str) -> dict[str, Any]:
    """Every tensor of a Hugging Face checkpoint's safetensors files, in memory (torch, CPU)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for shard in sorted(Path(checkpoint).glob("*.safetensors")):
        tensors |= {name: t.clone() for name, t in load_file(str(shard)).items()}  # off the file's mapping
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors in {checkpoint}")
    return tensors


class _Staged:
    _floor: dict[str, Any] | None = None

    def tpusync_stage_floor(self, checkpoint: str) -> int:
        """Reads `checkpoint` into this worker's memory; returns its bytes."""
        self._floor = checkpoint_tensors(checkpoint)
        return sum(t.numel() * t.element_size() for t in self._floor.values())

    def _staged(self) -> dict[str, Any]:
        tensors, self._floor = self._floor, None
        if tensors is None:
            raise RuntimeError("tpusync_stage_floor first")
        return tensors


class VllmLoadFloor(_Staged):
    """Mixed into vLLM's CPU worker."""

    model_runner: Any
    vllm_config: Any

    def tpusync_load_floor(self) -> float:
        from tpusync.engines.vllm.weight_transfer import load_in_place

        tensors = self._staged()
        start = time.perf_counter()
        load_in_place(self.model_runner.get_model(), self.vllm_config.model_config, iter(tensors.items()))
        return time.perf_counter() - start


class TpuLoadFloor(_Staged, WeightUpdate):
    """Mixed into tpu-inference's TPUWorker, beside tpusync's own update (WeightUpdate)."""

    def tpusync_load_floor(self) -> float:
        from tpusync.engines.tpu_inference.weights import load_in_place

        tensors = self._staged()
        start = time.perf_counter()
        load_in_place(self.model_runner, self.vllm_config, iter(tensors.items()))
        return time.perf_counter() - start
