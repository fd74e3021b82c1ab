"""The vLLM tier: real vLLM engines on the CPU with TPUSyncConnector, real tpusync sidecars.

Runs in the vLLM virtual environment (`make vllm-test`, tests/vllm/vllm.mk); the main .venv has
no vLLM, so there this folder collects nothing. Every engine process of the session starts at
once, in the background (they take most of the tier's time), and is shared by the tests:

    plain     vLLM without a connector: the reference output
    a, b      kv_both on sidecar `s`: a computes and saves, b (a fresh engine, not layerwise) loads
    local     kv_both on an in-process store (no sidecar)
    prefill   kv_producer on sidecar `p` (advertises p's data port)
    decode    kv_consumer on sidecar `d`, pulls from the prefill engine's sidecar
    fragile   kv_both on sidecar `f`, which a test kills
    api       the OpenAI-compatible API server, kv_both on sidecar `q` (engine core in its own process)
    rl        kv_both on sidecar `w`, updatable in place by the tpusync weight-transfer backend
    rl_api    the API server alike, on the same sidecar `w` (a second sampler on the host)
    fresh_b   vLLM started from checkpoint B (other weights): what `rl` must serve once updated to B

Sidecar `t` is the trainer's host, which pushes versions to `w`.
"""

from __future__ import annotations

import importlib.util
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.sidecar_pools import kill_and_remove, pool_path
from tests.conftest import not_collected
from tpusync.local.sidecars import write_secret

_vllm = importlib.util.find_spec("vllm")
if _vllm is None or _vllm.origin is None:  # no vLLM (tests/vllm itself can pass for a namespace package)
    collect_ignore_glob = not_collected("tests/vllm", "no vLLM here; `make vllm-test` runs it in its own environment")

SECRET = b"vllm-tier-secret-0123456789abcdef"


@dataclass
class Cluster:
    work: Path
    secret: Path
    engines: dict = field(default_factory=dict)
    sidecars: dict = field(default_factory=dict)
    pools: dict = field(default_factory=dict)
    model_b: str = ""
    _reference: dict = field(default_factory=dict)

    def __getattr__(self, name: str):
        if name in ("engines", "sidecars"):
            raise AttributeError(name)
        if name in self.engines:
            return self.engines[name]
        if name in self.sidecars:
            return self.sidecars[name]
        raise AttributeError(name)

    def launch(self, name: str, shared_dir: Path | None = None):
        """Starts sidecar `name` (again: on the same pool file and control socket); with
        `shared_dir`, on that shared tier."""
        from harness.tinymodel import BLOCK_BYTES
        from tpusync.local import sidecars as sidecar_mod

        pool = self.pools.setdefault(name, pool_path("vllm", name))
        self.sidecars[name] = sidecar_mod.launch(pool_path=pool, secret_file=str(self.secret), dram_bytes=32 << 20,
                                                 block_bytes=BLOCK_BYTES,
                                                 control_socket=str(self.work / f"{name}.sock"),
                                                 shared_dir=str(shared_dir) if shared_dir else None,
                                                 shared_layout="tinymodel", peers=[] if shared_dir else None,
                                                 stderr=subprocess.DEVNULL)
        return self.sidecars[name]

    def store(self, name: str):
        """A client of sidecar `name`'s block store, as an engine in its pod would have."""
        from tpusync import KVStore

        return KVStore.connect(f"unix://{self.sidecars[name].control_socket}")

    def reference(self, prompt: list[int], max_tokens: int = 16) -> list[int]:
        """The output of vLLM without any connector (greedy)."""
        key = (tuple(prompt), max_tokens)
        if key not in self._reference:
            self._reference[key] = self.engines["plain"].generate(prompt, max_tokens)["token_ids"]
        return self._reference[key]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    from harness.engines import EngineSpec
    from harness.tinymodel import build

    work = tmp_path_factory.mktemp("vllm")
    secret = work / "secret"
    write_secret(secret, SECRET + b"\n")
    c = Cluster(work, secret)
    try:
        for name in ("s", "p", "d", "f", "q", "empty", "w", "t"):
            c.launch(name)
        (work / "shared").mkdir()  # the mount every host of a pool shares
        for name in ("sh1", "sh2"):  # two hosts on one shared tier, dialing no peer
            c.launch(name, shared_dir=work / "shared")
        base = EngineSpec(str(build(work / "model")), work)
        c.model_b = str(build(work / "model_b", seed=1))
        sock = {n: s.control_socket for n, s in c.sidecars.items()}
        specs = {
            "plain": base,
            "a": base.connector("kv_both", control_socket=sock["s"]),
            "b": base.connector("kv_both", control_socket=sock["s"], layerwise=False),
            "local": base.connector("kv_both", store="local"),
            "prefill": base.connector("kv_producer", control_socket=sock["p"], data_address=c.sidecars["p"].address),
            "decode": base.connector("kv_consumer", control_socket=sock["d"]),
            "fragile": base.connector("kv_both", control_socket=sock["f"], retry_s=0),   # reconnect on the next call
            "shared_a": base.connector("kv_both", control_socket=sock["sh1"]),
            "shared_b": base.connector("kv_both", control_socket=sock["sh2"]),
            "rl": base.weight_transfer().connector("kv_both", control_socket=sock["w"]),
            "fresh_b": EngineSpec(c.model_b, work),
        }
        for name, spec in specs.items():
            c.engines[name] = spec.start(name)
        c.engines["api"] = base.connector("kv_both", control_socket=sock["q"],
                                          data_address=c.sidecars["q"].address).serve("api")
        c.engines["rl_api"] = base.weight_transfer().connector("kv_both", control_socket=sock["w"]).serve("rl_api")
        for engine in c.engines.values():
            engine.wait_ready()
        yield c
    finally:
        for engine in c.engines.values():
            engine.stop()
        kill_and_remove(c.sidecars.values(), c.pools.values())
