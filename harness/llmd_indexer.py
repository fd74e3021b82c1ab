"""llm-d's own indexer (tests/llmd/indexer, built by tests/llmd/build-indexer.sh) as the
router's precise-prefix-cache producer, and vLLM engines publishing to it under a pod's topic:
the vLLM and tpu-inference tiers both check what the index holds with these."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness import REPO
from harness.engines import Engine, EngineSpec, prompt
from harness.polling import wait_for
from harness.tinymodel import BLOCK_SIZE
from tpusync.local.servers import interrupt

MODEL = "tiny"
AUDIT_S = 3600.0  # past every wait here: what the sidecar changes can reach the index only by its feed
WEIGHTS = [{"name": "gpu", "weight": 1.0}, {"name": "cpu", "weight": 0.8}, {"name": "disk", "weight": 0.5}]


BUILD_SCRIPT = REPO / "tests/llmd/build-indexer.sh"


def build_indexer() -> str:
    """Builds llm-d's indexer if its cached binary is missing (minutes, once) and returns its path."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


def indexer_binary() -> str:
    """llm-d's indexer, built by tests/llmd/build-indexer.sh (`make vllm-test` builds it first)."""
    path = os.environ.get("TPUSYNC_LLMD_INDEXER") or subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print"], check=True, capture_output=True,
        text=True).stdout.strip().splitlines()[-1]
    if not os.access(path, os.X_OK):
        pytest.fail(f"llm-d's indexer is not built at {path}: run `make llmd-indexer` (make vllm-test does)")
    return path


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        result: dict[str, Any] = json.load(resp)
        return result


class Indexer:
    """llmd-indexer: llm-d's indexer wired as the router's precise-prefix-cache-producer."""

    def __init__(self, binary: str, block: int, *, engine_type: str | None = None) -> None:
        events: dict[str, Any] = {"topicFilter": "kv@", "discoverPods": False}
        if engine_type is not None:  # llm-d's adapter for the engine's wire format (default: vLLM's)
            events["engineType"] = engine_type
        parameters = {"tokenProcessorConfig": {"blockSizeTokens": block}, "kvEventsConfig": events,
                      "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": False},
                                        "kvCacheBackendConfigs": WEIGHTS}}
        self.block = block
        self.process = subprocess.Popen([binary, "--config", json.dumps(parameters)], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"llmd-indexer exited with {self.process.wait()}")
        self.url = f"http://{json.loads(line)['listen']}"

    def subscribe(self, pod: str, endpoint: str) -> None:
        post(self.url + "/subscribe", {"pod": pod, "endpoint": endpoint})

    def score(self, tokens: list[int]) -> dict[str, Any]:
        return post(self.url + "/score", {"tokens": tokens, "model": MODEL, "pods": []})

    def tiers(self, tokens: list[int], pod: str) -> dict[str, int]:
        """Per tier, the pod's blocks of `tokens` from the first (llm-d's blocks)."""
        tiers: dict[str, int] = self.score(tokens)["pods"].get(pod, {}).get("tiers", {})
        return tiers

    def stop(self) -> None:
        interrupt(self.process, grace=10)


class Pod:
    """A vLLM engine and the pod name its KV-event topic carries. `extra`: the connector's
    kv_connector_extra_config; `relay`: the connector publishes on its own, relaying vLLM's."""

    def __init__(self, name: str, base: EngineSpec, role: str, work: Path, port: int, relay: bool = False,
                 **extra: Any) -> None:
        self.pod = f"127.0.0.1:{port}"  # a name in the topic; nothing listens there
        self.endpoint = f"ipc://{work}/events-{name}"
        engine_endpoint = self.endpoint
        if relay:
            extra["kv_events_endpoint"], engine_endpoint = self.endpoint, "inproc://vllm-kv-events"
        spec = base.connector(role, kv_events_audit_s=AUDIT_S, **extra)
        self.engine: Engine = spec.events(engine_endpoint, f"kv@{self.pod}@{MODEL}").start(name)

    def generate(self, tokens: list[int], max_tokens: int = 1, **kw: Any) -> dict[str, Any]:
        return self.engine.generate(tokens, max_tokens, **kw)


def eventually(check: Callable[[], Any], step: Callable[[], Any] | None = None, timeout_s: float = 60) -> Any:
    """Polls `check()` (a request to the indexer) until it is truthy; the last value otherwise.
    `step` runs before each poll: a request that makes an engine without a relay step, so vLLM
    publishes what the connector's feed reported."""
    return wait_for("the indexer to see the change", check, timeout_s, interval=0.05, step=step,
                    raise_on_timeout=False)


def held(n_tokens: int, block: int) -> int:
    """llm-d blocks of the full vLLM blocks of an n-token prompt (what a store of them serves)."""
    return n_tokens // BLOCK_SIZE * BLOCK_SIZE // block


def connect(ix: Indexer, p: Pod, seed: int) -> None:
    """Subscribes and waits until the index has the engine's events: a ZMQ PUB drops what it
    publishes before the subscription arrives, so probe prompts are served until one shows."""
    ix.subscribe(p.pod, p.endpoint)
    for i in range(40):
        probe = prompt(seed + i, 64)
        p.generate(probe)
        if eventually(lambda probe=probe: ix.tiers(probe, p.pod), timeout_s=1):
            return
    raise AssertionError(f"{ix.url} never received {p.pod}'s events")
