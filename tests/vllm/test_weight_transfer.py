"""RL weight updates into running vLLM engines through vLLM's weight-transfer API, backend tpusync.

A torch trainer (HF transformers' Qwen3, the checkpoint's own module) publishes on its host's
sidecar `t`; versions are pushed to the samplers' host `w`, where two engines run: `rl` (the
offline LLM API) and `rl_api` (the OpenAI server, driven by vLLM's own HTTP client). Every
check compares generated tokens with an engine started from the same weights on disk.
The tests run in order: each states the version it leaves the engines on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from harness.engines import EngineError, delta, prompt

MODEL = "tiny-policy"
TRAINER = Path(__file__).with_name("trainer_proc.py")


class LLMClient:
    """vLLM's VLLMWeightSyncClient protocol over the engine processes' LLM methods."""

    def __init__(self, *engines):
        self.engines = engines

    def init_weight_transfer_engine(self, init_info):
        for e in self.engines:
            e.weights("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        for e in self.engines:
            e.weights("start_weight_update")

    def update_weights(self, update_info):
        for e in self.engines:
            e.weights("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        for e in self.engines:
            e.weights("finish_weight_update", weight_version)


def module(checkpoint: str):
    import torch
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


def trainer(cluster, client, checkpoint: str):
    """The trainer's end of vLLM's weight transfer, built by vLLM's own trainer factory."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from tpusync.engines.vllm.plugin import register
    from tpusync.engines.vllm.weight_transfer import TpusyncTrainerInitInfo

    register()  # a trainer process loads no vLLM plugins: it registers the backend itself
    info = TpusyncTrainerInitInfo(rank=0, model=MODEL, control_socket=cluster.sidecars["t"].control_socket,
                                  samplers=[cluster.sidecars["w"].address],
                                  sampler_control_socket=cluster.sidecars["w"].control_socket, timeout_s=60)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(module(checkpoint)))


def push(cluster, checkpoint: str, version: int) -> None:
    """Publishes a checkpoint as `version` on the trainer host and pushes it to the samplers' host,
    updating no engine."""
    from tpusync import KVStore, VersionedWeights

    sync = VersionedWeights(KVStore.connect(f"unix://{cluster.sidecars['t'].control_socket}"), MODEL)
    sync.publish(dict(module(checkpoint).named_parameters()), version)
    sync.push_weights([cluster.sidecars["w"].address], version).result(60)
    sync.close()


def update(engine, version: int, timeout_s: float = 60) -> None:
    """One update of an engine whose backend is initialised, through the LLM methods."""
    client = LLMClient(engine)
    client.start_weight_update()
    client.update_weights({"version": version, "timeout_s": timeout_s})  # an error here ends the update
    client.finish_weight_update(str(version))


def post(url: str) -> dict:
    req = urllib.request.Request(url, b"", {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


P = prompt(300, 100)


@pytest.fixture(scope="module")
def rl(cluster):
    cluster.rl.wait_ready()
    return cluster.rl


def test_engine_updated_in_place_serves_the_new_weights(cluster, rl):
    assert rl.generate(P)["token_ids"] == cluster.reference(P)  # A; the prompt's blocks saved on w, keyed for A
    before = rl.stats()
    want = cluster.fresh_b.generate(P)["token_ids"]
    assert want != cluster.reference(P), "checkpoints A and B must generate differently"

    version = trainer(cluster, LLMClient(rl), cluster.model_b).send_weights()

    assert rl.weights("get_weight_version") == str(version)
    rl.call("reset_prefix_cache")  # vLLM's own prefix cache predates the update (its contract)
    assert rl.generate(P)["token_ids"] == want
    after = rl.stats()
    # The store still holds the prompt's blocks computed under A: none of them was loaded.
    assert delta(after, before)["matched_tokens"] == 0
    rl.call("reset_prefix_cache")
    assert rl.generate(P)["token_ids"] == want  # what B computed is in the store, under B's keys, and loads
    assert delta(rl.stats(), after)["matched_tokens"] > 0


def test_trainer_killed_mid_publish_leaves_the_engine_serving(cluster, rl):
    from tpusync.weights.head import read_head

    t = cluster.sidecars["t"]
    head = read_head(t.pool_path, MODEL) or 0
    killed = subprocess.run([sys.executable, str(TRAINER), t.control_socket, MODEL, str(cluster.work / "model"),
                             str(head + 1), "3"], capture_output=True, timeout=300)
    assert killed.returncode == 9, killed.stderr.decode()[-2000:]
    assert read_head(t.pool_path, MODEL) == head

    with pytest.raises(EngineError, match="did not arrive"):
        update(rl, head + 1, timeout_s=1)
    assert rl.generate(P)["token_ids"] == cluster.fresh_b.generate(P)["token_ids"]  # still B, serving


def test_sampler_that_missed_versions_catches_up_to_the_newest(cluster, rl):
    from tpusync.weights.head import read_head

    head = read_head(cluster.sidecars["t"].pool_path, MODEL) or 0
    c = cluster.work / "model_c"
    if not c.exists():
        from harness.tinymodel import build

        build(c, seed=2)
    push(cluster, str(c), head + 1)                 # missed
    push(cluster, str(cluster.work / "model"), head + 2)  # the newest: A again

    update(rl, head + 1)
    rl.call("reset_prefix_cache")
    assert rl.generate(P)["token_ids"] == cluster.reference(P)  # A's tokens: it loaded head + 2


def test_two_samplers_on_a_host_over_http_with_a_request_in_flight(cluster, rl):
    """rl_api is paused (mode wait: the request in flight finishes on the old weights), updated
    over vLLM's HTTP routes, resumed; rl loads the same pushed copy."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    api = cluster.rl_api.wait_ready()
    long_prompt, n = prompt(301, 60), 900
    old = api.complete(long_prompt, max_tokens=n)["choices"][0]["token_ids"]  # A, before any update
    w = cluster.store("w")
    put_before = w.stats()["bytes_put"]

    in_flight: dict = {}
    request = threading.Thread(target=lambda: in_flight.update(api.complete(long_prompt, max_tokens=n)))
    request.start()
    deadline = time.monotonic() + 120
    while not api.metric("vllm:num_requests_running") and request.is_alive():  # until the engine runs it
        assert time.monotonic() < deadline, "the request never started running"
    assert request.is_alive(), "the request finished before the pause: nothing was in flight"
    post(f"{api.url}/pause?mode=wait&clear_cache=true")  # returns once the request in flight is done
    request.join(60)
    assert in_flight["choices"][0]["token_ids"] == old
    assert in_flight["choices"][0]["finish_reason"] == "length"

    eng = trainer(cluster, HTTPVLLMWeightSyncClient(api.url), cluster.model_b)
    version = eng.send_weights()
    post(f"{api.url}/resume")
    update(rl, version)  # from the copy already on host w
    landed = w.stats()["bytes_put"] - put_before
    rl.call("reset_prefix_cache")

    want = cluster.fresh_b.generate(P)["token_ids"]
    assert api.complete(P)["choices"][0]["token_ids"] == want
    assert rl.generate(P)["token_ids"] == want
    nbytes = sum(p.numel() * 4 for p in module(cluster.model_b).parameters())
    assert nbytes <= landed < 1.5 * nbytes, f"host w stored {landed} bytes for a {nbytes}-byte version"


def test_a_jax_trainer_updates_the_engine(cluster, rl, tmp_path):
    """A JAX process publishes checkpoint A's tensors (HF names, jax.Arrays) on the engine's host."""
    import numpy as np
    from safetensors.numpy import load_file
    from test_torch_weights import JAX_PROC, JAX_PY

    from tpusync.weights.head import read_head

    w = cluster.sidecars["w"]
    version = (read_head(w.pool_path, MODEL) or 0) + 1
    np.savez(tmp_path / "a.npz", **load_file(str(cluster.work / "model" / "model.safetensors")))
    done = subprocess.run([str(JAX_PY), str(JAX_PROC), "checkpoint", w.control_socket, MODEL, str(version),
                           str(tmp_path / "a.npz")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert rl.generate(P)["token_ids"] != cluster.reference(P)  # B before
    update(rl, version)
    rl.call("reset_prefix_cache")
    assert rl.generate(P)["token_ids"] == cluster.reference(P)  # A, from JAX
