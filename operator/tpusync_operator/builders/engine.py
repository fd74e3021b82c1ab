"""Engine command lines per engine type (pure).

The flags below are the contract with the engines; each engine's flag set at its pinned
version is recorded in ..versions (with the upstream file it was read from) and the unit
tests check every rendered flag against it; tests/vllm parses the vLLM ones with vLLM itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from .. import versions
from ..models import DisaggregatedServingSpec, ModelRef
from . import sglang_pd
from .common import Owner, env_from_fields, verbatim
from .sidecar import CONTROL_SOCKET

# Pinned defaults (override with spec.engine.image; sglang-jax has none: see sglang_pd.py).
DEFAULT_IMAGES = {
    "reference": versions.SERVING_IMAGE,
    "vllm-tpu": versions.VLLM_TPU_IMAGE,   # upstream's vllm-tpu plus tpusync: both connectors load from it
}
# vLLM on TPU runs through tpu-inference, whose platform accepts only a few kv_connector names
# (tpu_inference 0.32.0 platforms/tpu_platform.py, check_and_update_config), TPUConnector among
# them; vLLM takes the class of that name from kv_connector_module_path (its kv_connector/factory.py).
TPU_CONNECTOR_NAME = "TPUConnector"
# connector tpusync: tpusync's connector for tpu-inference (python/tpusync/engines/tpu_inference).
TPUSYNC_CONNECTOR_MODULE = "tpusync.tpu_inference.connector"
# With tpusync's connector, vLLM's KV-events publisher binds in-process and the connector relays it,
# its own events between vLLM's, on the pod's KV-events port (python/tpusync/engines/connector/relay.py): what the
# sidecar
# demotes or evicts reaches the router while the engine is idle, not at its next step.
# vLLM binds inproc:// endpoints (vllm 0.32.0 distributed/kv_events.py, _is_bind_endpoint).
VLLM_RELAYED_KV_EVENTS = "inproc://tpusync-vllm-kv-events"
# connector tpu-inference: tpu_inference's own TPUConnector, with the fix vLLM 0.32 needs for
# correct decode tokens (python/tpusync/engines/tpu_inference/upstream_fix.py), and its KV transfer and
# side-channel ports.
TPU_INFERENCE_CONNECTOR_MODULE = "tpusync.tpu_inference.upstream_fix"
TPU_INFERENCE_PORTS = {"tpu-kv": 9100, "tpu-kv-side": 9600}
# connector tpu-sync-compatible: tpu_inference's own connector for upstream TPU Sync (0.32.0
# tpu_inference/distributed/tpu_raiden_connector.py, class TPUConnector), whose
# tpu_raiden.api.jax.kv_cache_manager import tpusync serves (python/tpusync/engines/upstream) when
# TPUSYNC_UPSTREAM_API=1. The decode side dials the prefill pod at VLLM_HOST_IP and
# TPU_KV_TRANSFER_PORT (tpu_inference/distributed/utils.py), which is the sidecar's data port.
TPU_SYNC_COMPATIBLE_MODULE = "tpu_inference.distributed.tpu_raiden_connector"

# Engine pod volumes (spec.storage): weights and the XLA/JAX compile cache.
WEIGHTS_DIR = "/models"
HF_HOME = f"{WEIGHTS_DIR}/huggingface"
COMPILE_CACHE_DIR = "/cache/xla"


# Multi-host vLLM on TPU, as tpu-inference runs it (versions.RAY): one Ray cluster per slice, the
# head on the LWS leader, a Ray worker on every other host, and `vllm serve` on the leader only
# (tpu-inference's Ray executor places one TPU worker per host). LWS injects LWS_LEADER_ADDRESS
# (the leader's DNS name) and LWS_GROUP_SIZE (hosts of the group) into every container.
RAY_PORT = 6379
# Ray's object store lives in /dev/shm, which the sidecar's DRAM tier fills up to its size
# limit less 1 GiB: Ray gets a fixed 512 MiB of that headroom instead of 30% of the node.
RAY_OBJECT_STORE_BYTES = 512 << 20
RAY_HEAD_ARGS = ["--head", f"--port={RAY_PORT}", f"--object-store-memory={RAY_OBJECT_STORE_BYTES}",
                 "--disable-usage-stats"]
RAY_WORKER_ARGS = [f'--address="$LWS_LEADER_ADDRESS:{RAY_PORT}"', f"--object-store-memory={RAY_OBJECT_STORE_BYTES}",
                   "--disable-usage-stats", "--block"]
# The leader starts the head, waits until every host of the slice has joined, then serves.
RAY_LEADER_SCRIPT = "\n".join([
    "set -e",
    "ray start " + " ".join(RAY_HEAD_ARGS),
    "until python3 -c 'import ray, sys; ray.init(address=\"auto\", logging_level=\"ERROR\"); "
    "sys.exit(sum(n[\"Alive\"] for n in ray.nodes()) < int(sys.argv[1]))' \"$LWS_GROUP_SIZE\"; do sleep 5; done",
    'exec vllm "$@"',
])
# A worker waits for the head's port (the leader may start later), then joins and stays.
RAY_WORKER_SCRIPT = "\n".join([
    "until python3 -c 'import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)' "
    f'"$LWS_LEADER_ADDRESS" {RAY_PORT}; do sleep 5; done',
    "exec ray start " + " ".join(RAY_WORKER_ARGS),
])
MultiHost = Literal["leader", "worker"] | None
# A multi-host replica of the reference engine is one JAX program, a process per host
# (tpusync.engines.reference.slice); process 0, on the LWS leader, runs jax.distributed's coordinator here.
# LWS v0.9.0 injects LWS_LEADER_ADDRESS and LWS_WORKER_INDEX into every container of the group
# (api/leaderworkerset/v1/leaderworkerset_types.go, pkg/utils/pod/pod_utils.go line 165).
SLICE_COORDINATOR_PORT = 7620


@dataclass(frozen=True)
class ModelSource:
    """spec.model.uri resolved: what the engine is given to load."""
    scheme: Literal["hf", "gs", "path"]
    ref: str                      # a Hugging Face repo id, a gs:// URI, or a path

    @classmethod
    def of(cls, model: ModelRef) -> ModelSource:
        uri = model.uri
        if uri.startswith("hf://"):
            return cls("hf", uri[len("hf://"):])
        if uri.startswith("gs://"):
            return cls("gs", uri)
        return cls("path", uri)


def engine_image(spec: DisaggregatedServingSpec) -> str:
    """The engine's image; tpusync's own from the registry of the operator's configuration
    (versions.from_registry: the chart's imageRegistry)."""
    return versions.from_registry(spec.engine.image or DEFAULT_IMAGES[spec.engine.type])


def kv_events_topic(spec: DisaggregatedServingSpec) -> str:
    """The KV-event topic in the form llm-d's pod discovery expects, kv@<pod ip>:<port>@<model>:
    llm-d names a pod by the address and port it routes to, the InferencePool's target port
    (spec.port), not the engine's own port behind a decode pod's routing proxy
    (docs/block-keys.md). $(POD_IP) is for the kubelet to expand; the model name is not."""
    return f"kv@$(POD_IP):{spec.port}@{verbatim(spec.model.name)}"


def engine_command(owner: Owner, spec: DisaggregatedServingSpec, role: str, *, port: int, tensor_parallel: int,
                   data_port: int, kv_events_port: int, multi_host: MultiHost = None,
                   hosts: int = 1) -> tuple[list[str], list[str]]:
    """(command, args) for one engine process serving `role` ("prefill" or "decode") on `port`.

    `tensor_parallel` counts TensorCores (JAX devices), not chips: Slice.tensor_parallel. The
    engine publishes the KV events (it knows the tokens of each block); `data_port` is the
    pod's sidecar data port, advertised to decode pods in kv_transfer_params. `multi_host`
    names the pod's part in a multi-host replica of `hosts` (a LeaderWorkerSet group). Every string
    from the spec goes through `verbatim`: the kubelet expands no variable in it.
    """
    m = spec.model
    src = ModelSource.of(m)
    extra = [verbatim(a) for a in spec.role(role).args or []]
    if spec.engine.type == "reference":
        args = ["--role", role, "--host", "0.0.0.0", "--port", str(port), "--model", verbatim(src.ref),
                "--served-model-name", verbatim(m.name), "--control-socket", CONTROL_SOCKET,
                "--data-address", f"$(POD_IP):{data_port}", "--kv-events-endpoint", f"tcp://*:{kv_events_port}",
                "--kv-events-topic", kv_events_topic(spec)]
        if multi_host:  # each host's process moves its shards through its own pod's sidecar
            args += ["--num-processes", str(hosts), "--process-id", "$(LWS_WORKER_INDEX)",
                     "--coordinator", f"$(LWS_LEADER_ADDRESS):{SLICE_COORDINATOR_PORT}"]
        return ["python", "-m", "tpusync.serving"], args + extra
    if spec.engine.type == "vllm-tpu":
        if multi_host == "worker":
            return ["sh", "-c", RAY_WORKER_SCRIPT], []
        args = vllm_args(spec, role, src, port=port, tensor_parallel=tensor_parallel, data_port=data_port,
                         kv_events_port=kv_events_port) + extra
        if multi_host == "leader":
            return ["sh", "-c", RAY_LEADER_SCRIPT, "vllm"], ["serve", *args]
        return ["vllm", "serve"], args
    # sglang-jax, with its own P/D (sglang_pd.py)
    args = ["--model-path", verbatim(src.ref), "--host", "0.0.0.0", "--port", str(port),
            "--served-model-name", verbatim(m.name), "--tp-size", str(tensor_parallel)]
    if m.revision:
        args += ["--revision", verbatim(m.revision)]
    return ["python", "-m", "sgl_jax.launch_server"], args + sglang_pd.engine_args(owner, role) + extra


def kv_transfer_config(spec: DisaggregatedServingSpec, role: str, data_port: int,
                       kv_events_port: int) -> dict[str, Any]:
    """vLLM's --kv-transfer-config of one role (tests/tpu_inference runs real engines with it)."""
    kv = {"kv_connector": TPU_CONNECTOR_NAME, "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
          # A block that cannot be loaded after all is recomputed, not a failed request.
          "kv_load_failure_policy": "recompute"}
    if spec.kv_transfer.connector == "tpu-inference":
        return kv | {"kv_connector_module_path": TPU_INFERENCE_CONNECTOR_MODULE}
    if spec.kv_transfer.connector == "tpu-sync-compatible":
        return kv | {"kv_connector_module_path": TPU_SYNC_COMPATIBLE_MODULE}
    return kv | {"kv_connector_module_path": TPUSYNC_CONNECTOR_MODULE,
                 "kv_connector_extra_config": {"control_socket": CONTROL_SOCKET,
                                               "data_address": f"$(POD_IP):{data_port}",
                                               "kv_events_endpoint": f"tcp://*:{kv_events_port}"}}


def vllm_args(spec: DisaggregatedServingSpec, role: str, src: ModelSource, *, port: int, tensor_parallel: int,
              data_port: int, kv_events_port: int) -> list[str]:
    """`vllm serve` arguments (after the subcommand) of one role."""
    m = spec.model
    kv = kv_transfer_config(spec, role, data_port, kv_events_port)
    # KV events for llm-d's precise prefix-cache scoring, on the pod's KV-events port.
    relayed = "kv_events_endpoint" in kv.get("kv_connector_extra_config", {})
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": VLLM_RELAYED_KV_EVENTS if relayed else f"tcp://*:{kv_events_port}",
              "topic": kv_events_topic(spec)}
    args = [verbatim(src.ref), "--port", str(port), "--served-model-name", verbatim(m.name), "--enable-prefix-caching",
            "--tensor-parallel-size", str(tensor_parallel),
            "--kv-transfer-config", json.dumps(kv, separators=(",", ":"), sort_keys=True),
            "--kv-events-config", json.dumps(events, separators=(",", ":"), sort_keys=True)]
    if src.scheme == "hf" and m.revision:
        args += ["--revision", verbatim(m.revision)]
    if src.scheme == "gs":
        args += ["--load-format", versions.VLLM_STREAMING_LOAD_FORMAT]
    if m.max_model_len is not None:     # checked against the model by the planner (check_model_length)
        args += ["--max-model-len", str(m.max_model_len)]
    overrides = hf_overrides(m)
    if overrides:
        args += ["--hf-overrides", json.dumps(overrides, separators=(",", ":"), sort_keys=True)]
    if needs_render(spec, role):
        args.append(versions.VLLM_RENDER_FLAG)
    return args


def hf_overrides(model: ModelRef) -> dict[str, Any]:
    """vLLM's --hf-overrides for spec.model.ropeScaling (versions.VLLM_ROPE_OVERRIDES): the
    model's rope_parameters replaced by YaRN's (rope_theta kept: vLLM sets a dict override
    whole, and its get_rope falls back to 10000 without it), and max_position_embeddings set to
    the length YaRN serves, which vLLM checks --max-model-len against (it does not multiply a
    YaRN factor in: Transformers 5 takes max_position_embeddings as the scaled length)."""
    r = model.rope_scaling
    if r is None:
        return {}
    return {"max_position_embeddings": int(r.original_max_position_embeddings * r.factor),
            "rope_parameters": {"rope_type": r.type, "factor": r.factor,
                                "original_max_position_embeddings": r.original_max_position_embeddings,
                                "rope_theta": r.rope_theta}}


def vllm_argv(container: dict[str, Any]) -> list[str] | None:
    """The `vllm serve` arguments of a rendered engine container (single host, or a multi-host
    leader), or None when the container runs no vLLM server."""
    command, args = container.get("command", []), container.get("args", [])
    if command[:2] == ["vllm", "serve"]:
        return list(args)
    if command[:3] == ["sh", "-c", RAY_LEADER_SCRIPT] and args[:1] == ["serve"]:
        return list(args[1:])
    return None


def needs_render(spec: DisaggregatedServingSpec, role: str) -> bool:
    """The EPP's token-producer asks the decode Service for /v1/completions/render (precise
    prefix-cache routing); vLLM serves it only when told to (versions.VLLM_RENDER_FLAG)."""
    return (spec.engine.type == "vllm-tpu" and role == "decode" and spec.routing.enabled
            and spec.routing.precise_prefix_cache)


def engine_probe_path(spec: DisaggregatedServingSpec) -> str:
    return "/health"


def engine_ports(spec: DisaggregatedServingSpec) -> dict[str, int]:
    """Ports of the engine's own KV transfer, besides http and kv-events."""
    if spec.engine.type == "sglang-jax":
        return dict(sglang_pd.PORTS)
    return dict(TPU_INFERENCE_PORTS) if spec.kv_transfer.connector == "tpu-inference" else {}


def proxy_kv_connector(spec: DisaggregatedServingSpec) -> str:
    return spec.routing.proxy_kv_connector or ("sglang" if spec.engine.type == "sglang-jax" else "nixlv2")


def upstream_api_env(data_port: int) -> list[dict[str, Any]]:
    """The environment of a vllm-tpu engine on connector tpu-sync-compatible (tpu_inference's own
    upstream-TPU-Sync connector, served by tpusync.engines.upstream)."""
    return [{"name": "TPUSYNC_UPSTREAM_API", "value": "1"},
            {"name": "TPU_KV_TRANSFER_PORT", "value": str(data_port)},
            {"name": "VLLM_HOST_IP", "value": "$(POD_IP)"}]


def engine_env(owner: Owner, spec: DisaggregatedServingSpec, role: str, *, data_port: int,
               multi_host: MultiHost = None) -> list[dict[str, Any]]:
    env = env_from_fields() + [
        {"name": "TPUSYNC_CONTROL_SOCKET", "value": CONTROL_SOCKET},
        # Block keys hashed with Python's hash() must agree across replicas.
        {"name": "PYTHONHASHSEED", "value": "0"},
        {"name": "HOME", "value": "/tmp"},
        # Hugging Face downloads land on the weights volume, compiled programs on the cache volume.
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": versions.VLLM_XLA_CACHE_ENV, "value": COMPILE_CACHE_DIR},
        {"name": versions.JAX_COMPILE_CACHE_ENV, "value": COMPILE_CACHE_DIR},
    ]
    if multi_host and spec.engine.type == "vllm-tpu":
        # tpu-inference's multi-host backend; JAX_PLATFORMS empty as in its run_cluster.sh.
        env += [{"name": "TPU_MULTIHOST_BACKEND", "value": "ray"}, {"name": "JAX_PLATFORMS", "value": ""}]
        if spec.kv_transfer.connector == "tpusync":
            # Each host's worker names its own sidecar to decode engines (its kv_connector_extra_config,
            # the leader's, is handed to every worker alike; vLLM's Ray executor copies no TPUSYNC_ variable).
            env.append({"name": "TPUSYNC_DATA_ADDRESS", "value": f"$(POD_IP):{data_port}"})
    token = spec.model.token_secret_ref
    if token is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    if spec.engine.type == "sglang-jax":
        env.append(sglang_pd.secret_env(owner))
    if spec.kv_transfer.connector == "tpu-sync-compatible":
        env += upstream_api_env(data_port)
    env += [{"name": e.name, "value": verbatim(e.value)} for e in spec.engine.env or []]
    return env
