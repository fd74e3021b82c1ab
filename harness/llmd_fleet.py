"""Reference servers (python -m tpusync.serving) on real sidecars, publishing KV events that
llm-d's own indexer (github.com/llm-d/llm-d-kv-cache, tests/llmd/indexer) subscribes to: the
llm-d tier (tests/llmd) and bench/router_lag_bench.py run them.

    cluster = Cluster(work)                      # hosts, engines and indexers, stopped by stop()
    engine = cluster.engine(cluster.host(32), 32)
    ix = cluster.indexer(parameters(32))
    connect(ix, engine, probe)                   # subscribed, and its events arriving
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from harness.polling import wait_for
from harness.processes import free_port
from tpusync.engines.reference.model import ModelConfig
from tpusync.local import sidecars as sidecar
from tpusync.local.servers import interrupt
from tpusync.local.sidecars import write_secret

MODEL_NAME = "tpusync/reference"
BASE_MODEL = {"max_seq": 1024, "layers": 2, "d_model": 128, "mlp": 256}


def model_config(page_size: int) -> dict:
    return {**BASE_MODEL, "page_size": page_size}


def block_bytes(page_size: int) -> int:
    return -(-ModelConfig(**model_config(page_size)).page_bytes // 4096) * 4096


def parameters(block: int, **indexer_config) -> dict:
    """precise-prefix-cache-producer parameters, as an EndpointPickerConfig carries them."""
    return {"tokenProcessorConfig": {"blockSizeTokens": block},
            "kvEventsConfig": {"topicFilter": "kv@", "discoverPods": False},
            "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": False}, **indexer_config}}


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


class Publisher(Protocol):
    """What publishes KV events to an indexer: a reference server here, a serving pod on real nodes."""

    page_size: int

    @property
    def pod(self) -> str: ...            # the topic's pod: the address the router sends requests to

    @property
    def events_endpoint(self) -> str: ...

    def complete(self, prompt: list[int], max_tokens: int = 1, **extra) -> dict: ...


class PublisherAt:
    """A Publisher's pod, events endpoint and completions from where it listens: `ip`, its
    serving `port` and its KV-events `events_port` (the subclass's fields or properties)."""

    ip: str
    port: int
    events_port: int

    @property
    def pod(self) -> str:
        return f"{self.ip}:{self.port}"  # the topic's pod: the address the router sends requests to

    @property
    def url(self) -> str:
        return f"http://{self.pod}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://{self.ip}:{self.events_port}"

    def complete(self, prompt: list[int], max_tokens: int = 1, **extra) -> dict:
        return post(self.url + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra})


class Indexer:
    """llmd-indexer: llm-d's indexer wired as the router's precise-prefix-cache-producer."""

    def __init__(self, parameters: dict, binary: str | None = None):
        """Starts the indexer at `binary` (default: $TPUSYNC_LLMD_INDEXER, which `make llmd-test`
        sets; harness.llmd_indexer.build_indexer() builds it) with `parameters` (see parameters())."""
        binary = binary or os.environ.get("TPUSYNC_LLMD_INDEXER")
        if not binary:
            raise RuntimeError("no llm-d indexer: set TPUSYNC_LLMD_INDEXER (harness.llmd_indexer.build_indexer())")
        self.parameters = parameters
        self.process = subprocess.Popen([binary, "--config", json.dumps(parameters)], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"llmd-indexer exited with {self.process.wait()}")
        ready = json.loads(line)
        self.url = f"http://{ready['listen']}"
        self.block_size = ready["blockSizeTokens"]

    def subscribe(self, engine: Publisher) -> None:
        post(self.url + "/subscribe", {"pod": engine.pod, "endpoint": engine.events_endpoint})

    def forget(self, engine: Publisher) -> None:
        post(self.url + "/forget", {"pod": engine.pod})

    def sync(self, engine: Publisher, seq: int, timeout_s: float = 15) -> bool:
        """True once the engine's event batch `seq` (and every one before it) is in the index."""
        try:
            with urllib.request.urlopen(f"{self.url}/sync?pod={engine.pod}&seq={seq}&timeout_s={timeout_s}",
                                        timeout=timeout_s + 10):
                return True
        except urllib.error.HTTPError as e:
            if e.code == 504:
                return False
            raise

    def score(self, tokens: list[int], pods: list[str] | None = None, model: str = MODEL_NAME) -> dict:
        return post(self.url + "/score", {"tokens": tokens, "model": model, "pods": pods or []})

    def stop(self) -> None:
        interrupt(self.process, grace=10)
        self.process.stdout.close()


@dataclass
class Engine(PublisherAt):
    """A reference server (python -m tpusync.serving) publishing KV events on 127.0.0.1."""

    ip = "127.0.0.1"  # a class attribute, not a field
    role: str
    page_size: int
    control_socket: str | None = None
    data_address: str | None = None
    peers: list[str] = field(default_factory=list)
    port: int = 0
    events_port: int = 0
    extra: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None

    def start(self) -> Engine:
        self.port = self.port or free_port()
        args = [sys.executable, "-m", "tpusync.serving", "--role", self.role, "--port", str(self.port),
                "--served-model-name", MODEL_NAME, "--model-config", json.dumps(model_config(self.page_size)),
                "--kv-events-endpoint", f"tcp://127.0.0.1:{self.events_port}", "--no-warm-up"]
        if self.control_socket:
            args += ["--control-socket", self.control_socket]
        if self.data_address:
            args += ["--data-address", self.data_address]
        if self.peers:
            args += ["--peers", ",".join(self.peers)]
        args += self.extra
        env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.role} server exited with {self.process.wait()}")
        ready = json.loads(line)
        self.events_port = int(ready["kv_events_endpoint"].rsplit(":", 1)[1])
        return self

    def stop(self) -> None:
        if self.process is not None:
            interrupt(self.process, grace=15)
            self.process.stdout.close()
            self.process = None


class Host:
    """One sidecar (optionally with a disk tier) and the engines on it."""

    def __init__(self, work: Path, secret: Path, page_size: int, *, disk: bool = False, dram_blocks: int = 256,
                 shared_dir: Path | None = None, shared_scan_ms: int = 10000):
        self.name = uuid.uuid4().hex[:8]
        self.pool = f"/dev/shm/tpusync-llmd-{self.name}"
        self.disk_dir = work / f"disk-{self.name}" if disk else None
        bb = block_bytes(page_size)
        self.sidecar = sidecar.launch(pool_path=self.pool, secret_file=str(secret), dram_bytes=dram_blocks * bb,
                                      block_bytes=bb, control_socket=str(work / f"{self.name}.sock"),
                                      disk_dir=str(self.disk_dir) if disk else None,
                                      disk_bytes=4 * dram_blocks * bb if disk else 0,
                                      shared_dir=str(shared_dir) if shared_dir else None, shared_layout="llmd-test",
                                      extra=[f"--shared-evict-interval-ms={shared_scan_ms}"] if shared_dir else None,
                                      stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.sidecar.stop()
        if os.path.exists(self.pool):
            os.unlink(self.pool)


class Cluster:
    """Hosts, engines and indexers of one test module, stopped at the end."""

    def __init__(self, work: Path):
        self.work = work
        self.secret = work / "secret"
        write_secret(self.secret, uuid.uuid4().hex * 2)
        self.hosts: list[Host] = []
        self.engines: list[Engine] = []
        self.indexers: list[Indexer] = []

    def host(self, page_size: int, **kw) -> Host:
        h = Host(self.work, self.secret, page_size, **kw)
        self.hosts.append(h)
        return h

    def engine(self, host: Host | None, page_size: int, role: str = "both", peers: list[str] | None = None,
               extra: list[str] | None = None) -> Engine:
        e = Engine(role, page_size, control_socket=host.sidecar.control_socket if host else None,
                   data_address=host.sidecar.address if host else None, peers=peers or [], extra=extra or [])
        self.engines.append(e.start())
        return e

    def indexer(self, parameters: dict) -> Indexer:
        ix = Indexer(parameters)
        self.indexers.append(ix)
        return ix

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        for ix in self.indexers:
            ix.stop()
        for h in self.hosts:
            h.stop()


def connect(indexer: Indexer, engine: Publisher, probe: list[int]) -> None:
    """Subscribes `indexer` to `engine` and waits until it receives the engine's events: a ZMQ
    PUB drops what it publishes before the subscription arrives, so probe prompts (`probe`
    with one more token each time) are served until one of their batches shows up."""
    indexer.subscribe(engine)
    for i in range(40):
        seq = engine.complete(probe + [i % 256] * engine.page_size)["tpusync"]["kv_events_seq"]
        assert seq >= 0, "the engine published nothing for a prompt of full blocks"
        if indexer.sync(engine, seq, timeout_s=0.5):
            return
    raise AssertionError(f"{indexer.url} never received {engine.pod}'s events")


def eventually(check, timeout_s: float = 20):
    """Polls `check()` (each poll a request to the indexer) until it returns a truthy value; the
    last value otherwise. For changes the engine finds out by itself (its store audit)."""
    return wait_for("the indexer to see the change", check, timeout_s, interval=0.05, raise_on_timeout=False)


def served(indexer: Indexer, engine: Publisher, prompt: list[int], **extra) -> dict:
    """Serves `prompt` on `engine` and returns the response once the index has its events."""
    r = engine.complete(prompt, **extra)
    seq = r["tpusync"]["kv_events_seq"]
    assert seq >= 0, f"no KV events for a prompt of {len(prompt)} tokens"
    assert indexer.sync(engine, seq), f"event batch {seq} of {engine.pod} never reached the index"
    return r
