"""vLLM-on-tpu-inference engine processes for this tier, driven like the vLLM tier's engines.

    engine = TpuEngine("plain", EngineSpec(model_dir, logs))   # returns at once
    engine.generate(prompt, max_tokens=16)["token_ids"]          # the first call waits for vLLM

`TpuEngine` is harness/engines.py's Engine (same stdin/stdout protocol, same waiting and
teardown) started on `tpu_engine_proc.py` with JAX on the CPU, optionally inside a network
namespace (`NetNs`): tpu-inference's TPUConnector binds its side channel on every address
(`tcp://*:port`), so the tests run it where the only address is the namespace's loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from harness.engines import Engine, EngineSpec

ENGINE_SCRIPT = Path(__file__).with_name("tpu_engine_proc.py")

__all__ = ["EngineSpec", "NetNs", "Pods", "TpuEngine", "rendered_kv_transfer_config"]


def rendered_kv_transfer_config(connector: str, role: str, *, kv_role: str | None = None,
                                control_socket: str | None = None, data_address: str = "127.0.0.1:7600",
                                kv_events_endpoint: str | None = None) -> dict:
    """The --kv-transfer-config the operator renders for `role` of a vllm-tpu serving with
    `connector`, with what the pod fills in: $(POD_IP) and the data port (from `data_address`,
    the test sidecar's), and the control socket's path (test sidecars do not live in
    /run/tpusync). `kv_role` overrides the role's (a test engine that both saves and loads).
    tpusync's connector relays the KV events on `kv_events_endpoint` (tests bind no tcp://*),
    or leaves them to vLLM's publisher without it."""
    from tpusync_operator.builders.engine import kv_transfer_config
    from tpusync_operator.models import DisaggregatedServingSpec

    spec = DisaggregatedServingSpec.model_validate({
        "model": {"name": "m", "uri": "/models/m"}, "engine": {"type": "vllm-tpu"}, "poolRef": {"name": "pool"},
        "kvTransfer": {"connector": connector}})
    ip, port = data_address.rsplit(":", 1)
    kv = json.loads(json.dumps(kv_transfer_config(spec, role, int(port), 5557)).replace("$(POD_IP)", ip))
    extra = kv.get("kv_connector_extra_config", {})
    if "kv_events_endpoint" in extra:
        assert extra["kv_events_endpoint"] == "tcp://*:5557"
        if kv_events_endpoint is None:
            del extra["kv_events_endpoint"]
        else:
            extra["kv_events_endpoint"] = kv_events_endpoint
    if control_socket is not None:
        kv["kv_connector_extra_config"]["control_socket"] = control_socket
    if kv_role is not None:
        kv["kv_role"] = kv_role
    return kv


@dataclass
class TpuEngine(Engine):
    netns: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    tensor_parallel_size: int = 1  # on as many XLA host (CPU) devices, the KV cache sharded on `model`
    block_size: int | None = None  # vLLM's (tpu-inference's page size); None: tpu_engine_proc.BLOCK_SIZE
    python: str = sys.executable  # the tier's interpreter (a bench drives engines from another one)
    worker_extension_cls: str | None = None  # vLLM's worker_extension_cls

    def __post_init__(self) -> None:
        self.log_path = self.spec.logs / f"engine-{self.name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TPUSYNC_", "TPU_"))}
        env.update(JAX_PLATFORMS="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false",
                   HF_HUB_OFFLINE="1", **self.env)
        if self.tensor_parallel_size > 1:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={self.tensor_parallel_size}"
        arg = json.dumps({"model": self.spec.model, "kv_transfer_config": self.spec.kv_transfer_config,
                          "kv_events_config": self.spec.kv_events_config,
                          "tensor_parallel_size": self.tensor_parallel_size,
                          **({"block_size": self.block_size} if self.block_size else {}),
                          "worker_extension_cls": self.worker_extension_cls})
        cmd = [self.python, str(ENGINE_SCRIPT), arg]
        if self.netns is not None:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         text=True)


class NetNs:
    """A network namespace with only its loopback up, removed on close. Needs root and iproute2."""

    def __init__(self) -> None:
        self.name = f"tsti-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False)


class Pods:
    """A test module's simulated pods: sidecars (pool files in /dev/shm, one pool secret) and
    the engines on them; `close` stops the engines, kills the sidecars and removes the pools."""

    def __init__(self, work: Path, tag: str):
        from tpusync.local.sidecars import write_secret

        self.work, self.tag = work, tag
        self.secret = write_secret(work / "secret", os.urandom(16).hex())
        self.sidecars: dict = {}
        self.engines: dict[str, TpuEngine] = {}
        self._pools: list[str] = []

    def sidecar(self, name: str, *, dram_bytes: int, block_bytes: int):
        from tpusync.local import sidecars as sidecar

        pool = f"/dev/shm/tpusync-{self.tag}-{os.getpid()}-{name}-{uuid.uuid4().hex[:6]}"
        self._pools.append(pool)
        self.sidecars[name] = sidecar.launch(pool_path=pool, secret_file=str(self.secret), dram_bytes=dram_bytes,
                                             block_bytes=block_bytes, control_socket=str(self.work / f"{name}.sock"),
                                             stderr=subprocess.DEVNULL)
        return self.sidecars[name]

    def start(self, **engines: TpuEngine) -> None:
        """Adds the engines (started already: TpuEngine returns at once) and waits until all serve."""
        self.engines.update(engines)
        for e in self.engines.values():
            e.wait_ready()

    def close(self) -> None:
        for e in self.engines.values():
            e.stop()
        for car in self.sidecars.values():
            car.kill()
        for pool in self._pools:
            for path in (pool, pool + ".weights"):  # the pool file, and the weight heads beside it
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.exists(path):
                    os.unlink(path)
