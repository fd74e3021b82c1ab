"""Engine command lines per engine type (pure).

The flags below are the contract with the engines' owners; each is an assumption to keep
in sync with python/tpusync (reference engine, vLLM connector) and the engine images.
"""

from __future__ import annotations

import json
from typing import Any

from ..models import DisaggregatedServingSpec
from . import sglang_pd
from .common import Owner, env_from_fields
from .sidecar import CONTROL_SOCKET

# Pinned defaults (override with spec.engine.image; sglang-jax has none: see sglang_pd.py).
DEFAULT_IMAGES = {
    "reference": "ghcr.io/tpusync/tpusync-serving:0.1.0",
    "vllm-tpu": "docker.io/vllm/vllm-tpu:v0.11.1",
}
# tpusync's vLLM KV connector (python/tpusync); the name vLLM loads through kv_transfer_config.
VLLM_CONNECTOR = "TPUSyncConnector"
VLLM_CONNECTOR_MODULE = "tpusync.vllm.connector"
# tpu_inference's own connector (vLLM on TPU), with its KV transfer and side-channel ports.
TPU_INFERENCE_CONNECTOR = "TPUConnector"
TPU_INFERENCE_CONNECTOR_MODULE = "tpu_inference.distributed.tpu_connector"
TPU_INFERENCE_PORTS = {"tpu-kv": 9100, "tpu-kv-side": 9600}


def engine_image(spec: DisaggregatedServingSpec) -> str:
    return spec.engine.image or DEFAULT_IMAGES[spec.engine.type]


def engine_command(owner: Owner, spec: DisaggregatedServingSpec, role: str, *, port: int, chips: int,
                   data_port: int, kv_events_port: int) -> tuple[list[str], list[str]]:
    """(command, args) for one engine process serving `role` ("prefill" or "decode") on `port`.

    The engine publishes the KV events (it knows the tokens of each block); `data_port` is the
    pod's sidecar data port, advertised to decode pods in kv_transfer_params.
    """
    m = spec.model
    extra = list((spec.prefill if role == "prefill" else spec.decode).args or [])
    if spec.engine.type == "reference":
        args = ["--role", role, "--host", "0.0.0.0", "--port", str(port), "--model", m.uri,
                "--served-model-name", m.name, "--control-socket", CONTROL_SOCKET,
                "--data-address", f"$(POD_IP):{data_port}", "--kv-events-endpoint", f"tcp://*:{kv_events_port}",
                "--kv-layerwise" if spec.kv_transfer.layerwise else "--no-kv-layerwise"]
        return ["python", "-m", "tpusync.serving"], args + extra
    if spec.engine.type == "vllm-tpu":
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        if spec.kv_transfer.connector == "tpu-inference":
            kv: dict[str, Any] = {"kv_connector": TPU_INFERENCE_CONNECTOR,
                                  "kv_connector_module_path": TPU_INFERENCE_CONNECTOR_MODULE, "kv_role": kv_role}
        else:
            kv = {
                "kv_connector": VLLM_CONNECTOR,
                "kv_connector_module_path": VLLM_CONNECTOR_MODULE,
                "kv_role": kv_role,
                "kv_connector_extra_config": {"control_socket": CONTROL_SOCKET,
                                              "data_address": f"$(POD_IP):{data_port}",
                                              "layerwise": spec.kv_transfer.layerwise},
                # A block that cannot be loaded after all is recomputed, not a failed request.
                "kv_load_failure_policy": "recompute",
            }
        # KV events for llm-d's precise prefix-cache scoring, in the topic form its pod
        # discovery expects (kv@<pod ip>:<port>@<model>).
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_events_port}",
                  "topic": f"kv@$(POD_IP):{port}@{m.name}"}
        args = [m.uri, "--port", str(port), "--served-model-name", m.name, "--enable-prefix-caching",
                "--tensor-parallel-size", str(chips),
                "--kv-transfer-config", json.dumps(kv, separators=(",", ":"), sort_keys=True),
                "--kv-events-config", json.dumps(events, separators=(",", ":"), sort_keys=True)]
        return ["vllm", "serve"], args + extra
    # sglang-jax, with its own P/D (sglang_pd.py)
    args = ["--model-path", m.uri, "--host", "0.0.0.0", "--port", str(port), "--served-model-name", m.name,
            "--tp-size", str(chips), *sglang_pd.engine_args(owner, role)]
    return ["python", "-m", "sgl_jax.launch_server"], args + extra


def engine_probe_path(spec: DisaggregatedServingSpec) -> str:
    return "/health"


def engine_ports(spec: DisaggregatedServingSpec) -> dict[str, int]:
    """Ports of the engine's own KV transfer, besides http and kv-events."""
    if spec.engine.type == "sglang-jax":
        return dict(sglang_pd.PORTS)
    return dict(TPU_INFERENCE_PORTS) if spec.kv_transfer.connector == "tpu-inference" else {}


def proxy_kv_connector(spec: DisaggregatedServingSpec) -> str:
    return spec.routing.proxy_kv_connector or ("sglang" if spec.engine.type == "sglang-jax" else "nixlv2")


def engine_env(owner: Owner, spec: DisaggregatedServingSpec, role: str) -> list[dict[str, Any]]:
    env = env_from_fields() + [
        {"name": "TPUSYNC_ROLE", "value": role},
        {"name": "TPUSYNC_CONTROL_SOCKET", "value": CONTROL_SOCKET},
        # Block keys hashed with Python's hash() must agree across replicas.
        {"name": "PYTHONHASHSEED", "value": "0"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/cache/huggingface"},
    ]
    if spec.engine.type == "sglang-jax":
        env.append(sglang_pd.secret_env(owner))
    env += [{"name": e.name, "value": e.value} for e in spec.engine.env or []]
    return env
