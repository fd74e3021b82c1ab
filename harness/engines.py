"""Real vLLM engine processes and tpusync sidecars for the vLLM tier.

    spec = EngineSpec(model_dir, logs).connector("kv_both", control_socket=sock, layerwise=False)
    engine = spec.start("b")        # returns at once; the first call waits until vLLM is up
    out = engine.generate(prompt, max_tokens=16)
    out["token_ids"], engine.stats()["matched_tokens"]
    server = spec.serve("api")      # the OpenAI-compatible server instead of the offline API
    server.complete(prompt, kv_transfer_params={...})["kv_transfer_params"]
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tpusync.local.servers import interrupt

ENGINE_SCRIPT = Path(__file__).with_name("engine_proc.py")
BLOCK_SIZE = 32
START_TIMEOUT_S = 600  # several engines start at once on two cores
CALL_TIMEOUT_S = 180


class EngineError(RuntimeError):
    pass


@dataclass
class EngineSpec:
    model: str
    logs: Path
    kv_transfer_config: dict[str, Any] | None = None
    kv_events_config: dict[str, Any] | None = None   # vLLM's --kv-events-config (engine processes only)
    weight_transfer_config: dict[str, Any] | None = None  # vLLM's --weight-transfer-config
    kv_cache_bytes: int = 16 << 20  # the offline engines' KV cache (a larger model needs more)
    worker_extension_cls: str | None = None  # vLLM's worker_extension_cls (engine processes only)

    def connector(self, role: str, **extra: Any) -> EngineSpec:
        kv = {"kv_connector": "TPUSyncConnector", "kv_connector_module_path": "tpusync.vllm.connector",
              "kv_role": role, "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
        return dataclasses.replace(self, kv_transfer_config=kv)

    def events(self, endpoint: str, topic: str) -> EngineSpec:
        """Publishing KV events (vLLM's ZMQ publisher; an ipc:// or tcp://*: endpoint binds)."""
        return dataclasses.replace(self, kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                                           "endpoint": endpoint, "topic": topic})

    def weight_transfer(self, backend: str = "tpusync") -> EngineSpec:
        """Updatable in place through vLLM's weight-transfer API, with `backend`."""
        return dataclasses.replace(self, weight_transfer_config={"backend": backend})

    def start(self, name: str) -> Engine:
        return Engine(name, self)

    def serve(self, name: str) -> ApiServer:
        return ApiServer(name, self)


@dataclass
class Engine:
    name: str
    spec: EngineSpec
    proc: subprocess.Popen = field(init=False)
    _ready: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.log_path = self.spec.logs / f"engine-{self.name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSYNC_")}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        arg = json.dumps({"model": self.spec.model, "kv_transfer_config": self.spec.kv_transfer_config,
                          "kv_events_config": self.spec.kv_events_config,
                          "weight_transfer_config": self.spec.weight_transfer_config,
                          "kv_cache_bytes": self.spec.kv_cache_bytes,
                          "worker_extension_cls": self.spec.worker_extension_cls})
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), arg], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, text=True)

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineError(f"engine {self.name}: no answer in {timeout:.0f} s\n{self.log_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise EngineError(f"engine {self.name} exited with {self.proc.wait()}\n{self.log_tail()}")
                msg = json.loads(line)
                if "error" in msg:
                    raise EngineError(f"engine {self.name}: {msg['error']}")
                return msg
            if self.proc.poll() is not None:
                raise EngineError(f"engine {self.name} exited with {self.proc.returncode}\n{self.log_tail()}")

    def wait_ready(self) -> Engine:
        if not self._ready:
            self._read(START_TIMEOUT_S)
            self._ready = True
        return self

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        self.wait_ready()
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(CALL_TIMEOUT_S)

    def weights(self, call: str, *arg: Any, **kwargs: Any) -> Any:
        """LLM.<call>(*arg, **kwargs) in the engine process: vLLM's weight-transfer API, collective_rpc."""
        return self.call("weights", call=call, kwargs=kwargs, **({"arg": arg[0]} if arg else {}))["result"]

    def generate(self, prompt: list[int], max_tokens: int = 16, kv_transfer_params: dict | None = None) -> dict:
        out = self.call("generate", prompts=[prompt], max_tokens=max_tokens, kv_transfer_params=[kv_transfer_params])
        return out["outputs"][0]

    def stats(self) -> dict[str, int]:
        return self.call("stats")["stats"]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class ApiServer:
    """`python -m vllm.entrypoints.openai.api_server` as deployed: the engine core in a process of
    its own, kv_transfer_params in the HTTP bodies. Returns at once; the first call waits."""

    def __init__(self, name: str, spec: EngineSpec):
        self.name, self.log_path = name, spec.logs / f"server-{name}.log"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model,
                "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
                "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "1024", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "1024", "--enable-prefix-caching", "--seed", "0"]
        if spec.kv_transfer_config:
            args += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSYNC_")}
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        if spec.weight_transfer_config:
            # The weight-transfer and /pause routes are mounted only in vLLM's dev mode.
            args += ["--weight-transfer-config", json.dumps(spec.weight_transfer_config)]
            env["VLLM_SERVER_DEV_MODE"] = "1"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._ready = False

    def wait_ready(self) -> ApiServer:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready:
            if self.proc.poll() is not None:
                raise EngineError(f"server {self.name} exited with {self.proc.returncode}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    self._ready = r.status == 200
            except OSError as e:
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"server {self.name}: not healthy in {START_TIMEOUT_S} s\n{self.log_tail()}") from e
                time.sleep(1)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, prompt: list[int], max_tokens: int = 16, kv_transfer_params: dict | None = None) -> dict:
        """POST /v1/completions, greedy, with the generated token ids in choices[0].token_ids."""
        self.wait_ready()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=CALL_TIMEOUT_S) as r:
            return json.load(r)

    def metric(self, name: str) -> float:
        """The sum of a Prometheus metric's samples on /metrics (e.g. vllm:external_prefix_cache_hits_total)."""
        self.wait_ready()
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            lines = r.read().decode().splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))

    log_tail = Engine.log_tail

    def stop(self) -> None:
        interrupt(self.proc, grace=30)


def prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    """A reproducible random prompt of n token ids (0 is the EOS token: avoided)."""
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}
