"""The tpu-inference tier: real vLLM on tpu-inference (JAX), on the CPU.

Runs in its own environment (`make tpu-inference-test`, tests/tpu_inference/tpu_inference.mk):
Python 3.12 with vllm-tpu and tpu-inference 0.32.0, this clone's tpusync, and the test plugin
`tpusync_cpu_shim` (tests/tpu_inference/cpu_shim), which stands in for tpu-inference's TPU-only
kernels when JAX_PLATFORMS=cpu. Elsewhere (the main .venv) this folder collects nothing.

The model is the tiny random Qwen3 of harness/tinymodel.py, built once per session; the
reference for every engine's greedy tokens is HF transformers running the same checkpoint.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import not_collected

_spec = importlib.util.find_spec("tpu_inference")
if _spec is None or _spec.origin is None:  # tests/tpu_inference itself can pass for a namespace package
    collect_ignore_glob = not_collected("tests/tpu_inference", "no tpu-inference here; `make tpu-inference-test` "
                                        "runs it in its own environment")


class Reference:
    """Greedy tokens of HF transformers on the model (float32), cached per prompt."""

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self._model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple, list[int]] = {}

    def __call__(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._cache:
            with self._torch.no_grad():
                out = self._model.generate(self._torch.tensor([prompt]), max_new_tokens=max_tokens,
                                           min_new_tokens=max_tokens, do_sample=False)
            self._cache[key] = out[0, len(prompt):].tolist()
        return self._cache[key]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from harness.tinymodel import build

    return build(tmp_path_factory.mktemp("tpu-inference") / "model")


@pytest.fixture(scope="session")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="session")
def model_b(tmp_path_factory) -> Path:
    """Other weights of the same shapes (what an RL trainer would publish)."""
    from harness.tinymodel import build

    return build(tmp_path_factory.mktemp("tpu-inference-b") / "model", seed=1)


@pytest.fixture(scope="session")
def weights_host(tmp_path_factory):
    """A sidecar for weight versions (the engine host's, in a pod)."""
    from harness.sidecar_pools import lone_sidecar

    with lone_sidecar(tmp_path_factory.mktemp("tpu-inference-weights"), "tpuw", b"tpu-inference-weights-0123456789\n",
                      dram_bytes=16 << 20, block_bytes=64 << 10) as host:
        yield host


# tpu-inference's TPUConnector: ports inside the P/D pair's own network namespace.
KV_PORTS = {"prefill": "9100", "decode": "9101", "decode-fixed": "9102"}
SIDE_CHANNEL_PORT = "9600"  # the prefill engine's; decode engines connect to it


@pytest.fixture(scope="session")
def engines(model_dir, tmp_path_factory):
    """Every engine of the session, started at once (they take most of the tier's time):

        plain          no connector
        prefill        TPUConnector kv_producer            } in one network namespace,
        decode         TPUConnector kv_consumer, as shipped } talking over its loopback
        decode-fixed   TPUConnector kv_consumer with tpusync.tpu_inference.upstream_fix
        rl             no connector; tpusync's weight-update worker extension
    """
    from harness.tpu_engines import EngineSpec, NetNs, TpuEngine, rendered_kv_transfer_config

    logs = tmp_path_factory.mktemp("tpu-inference-logs")
    base = EngineSpec(str(model_dir), logs)

    def tpu_connector(role: str, module: str = "tpu_inference.distributed.tpu_connector"):
        return EngineSpec(base.model, logs, {"kv_connector": "TPUConnector", "kv_connector_module_path": module,
                                             "kv_role": role, "kv_load_failure_policy": "recompute"})

    # decode-fixed: what the operator renders for connector tpu-inference (the fixed class).
    fixed = rendered_kv_transfer_config("tpu-inference", "decode")
    assert fixed["kv_connector_module_path"] == "tpusync.tpu_inference.upstream_fix"

    netns = NetNs()
    started = {}
    try:
        started["plain"] = TpuEngine("plain", base)
        started["rl"] = TpuEngine("rl", base, worker_extension_cls="tpusync.engines.tpu_inference.weights.WeightUpdate")
        specs = {"prefill": tpu_connector("kv_producer"), "decode": tpu_connector("kv_consumer"),
                 "decode-fixed": EngineSpec(base.model, logs, fixed)}
        for name, spec in specs.items():
            started[name] = TpuEngine(name, spec, netns=netns.name,
                                      env={"VLLM_HOST_IP": "127.0.0.1", "TPU_KV_TRANSFER_PORT": KV_PORTS[name],
                                           "TPU_SIDE_CHANNEL_PORT": SIDE_CHANNEL_PORT})
        for engine in started.values():
            engine.wait_ready()
        yield started
    finally:
        for engine in started.values():
            engine.stop()
        netns.close()
