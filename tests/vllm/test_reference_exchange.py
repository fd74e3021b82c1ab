"""The reference engine and vLLM speak one prefill-to-decode contract (tpusync.kv.handoff): each
reads the other's kv_transfer_params with the one parser, and the one layout check decides.

Their models differ (the reference engine's JAX transformer, vLLM's tiny Qwen3), so the blocks of
one are never the other's KV: the right exchange is a refusal by the layout check (the message
names the fields that differ, the model and the format among them), counted where the operator
reads it (tpusync_kv_refused_handoffs_total), nothing pulled, the prompt computed, the tokens the
engine's own. A parse error instead (a field one side writes and the other does not read, or
reads otherwise) would be a second dialect, which this test exists to catch.

A vLLM API server (kv_both: a prefill for the reference decode, a decode for the reference
prefill) and two reference servers, each on a sidecar of its own. The reference servers run in
this clone's main environment (JAX), beside vLLM's (none)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import urllib.request
import uuid
from pathlib import Path

import pytest

from harness.engines import EngineSpec, prompt
from harness.tinymodel import BLOCK_BYTES, BLOCK_SIZE, build
from tpusync.local import sidecars as sidecar_mod
from tpusync.local.servers import start_server
from tpusync.local.sidecars import write_secret

REPO = Path(__file__).resolve().parents[2]
MAIN_PYTHON = REPO / ".venv" / "bin" / "python"   # the Makefile's VENV: JAX for the reference engine
REFERENCE = {"max_seq": 1024, "layers": 2, "d_model": 128, "mlp": 256, "page_size": BLOCK_SIZE}
TOKENS = 300                                # 9 full blocks of 32 tokens on both sides
REFUSED = "tpusync_kv_refused_handoffs_total"
PULLED = "tpusync_kv_pulled_blocks_total"
SECRET = b"vllm-reference-exchange-0123456789ab"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    if not MAIN_PYTHON.exists():
        pytest.fail(f"{MAIN_PYTHON}: the main environment (make install) runs the reference engine", pytrace=False)
    work = tmp_path_factory.mktemp("exchange")
    secret = write_secret(work / "secret", SECRET + b"\n")
    vocab, page_bytes = reference_model()
    block = max(BLOCK_BYTES, page_bytes)
    with contextlib.ExitStack() as stack:
        sidecars = {}
        for name in ("vx", "rp", "rd"):
            pool = f"/dev/shm/tpusync-vllm-{os.getpid()}-{name}-{uuid.uuid4().hex[:6]}"
            stack.callback(_remove, pool)
            sidecars[name] = stack.enter_context(sidecar_mod.launch(
                pool_path=pool, secret_file=secret, dram_bytes=32 << 20, block_bytes=block,
                control_socket=str(work / f"{name}.sock"), stderr=subprocess.DEVNULL))
        server = EngineSpec(str(build(work / "model")), work).connector(
            "kv_both", control_socket=sidecars["vx"].control_socket, data_address=sidecars["vx"].address
        ).serve("exchange-vllm")
        stack.callback(server.stop)
        logs = {}
        refs = {}
        for role, car in (("prefill", sidecars["rp"]), ("decode", sidecars["rd"])):
            logs[role] = work / f"reference-{role}.log"
            log = stack.enter_context(open(logs[role], "w"))
            refs[role] = start_server(role, model_config=REFERENCE, control_socket=car.control_socket,
                                      data_address=car.address, stderr=log, python=str(MAIN_PYTHON))
            stack.callback(refs[role].stop)
        server.wait_ready()
        yield {"vllm": server, **refs, "logs": logs, "vocab": vocab}


def reference_model() -> tuple[int, int]:
    """(vocab, page bytes) of the reference model: asked of the main environment (vLLM's has no JAX)."""
    code = ("import json, sys; from tpusync.engines.reference.model import ModelConfig; "
            "c = ModelConfig(**json.loads(sys.argv[1])); print(c.vocab, c.page_bytes)")
    out = subprocess.run([str(MAIN_PYTHON), "-c", code, json.dumps(REFERENCE)], capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]), int(out[1])


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def ref_metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def test_a_reference_prefills_hand_off_to_vllm_is_read_and_refused_by_the_layout_check(engines):
    server, ref = engines["vllm"], engines["prefill"]
    p = prompt(70, TOKENS, vocab=engines["vocab"])   # token ids both models take
    params = post(ref.url, {"prompt": p, "max_tokens": 1})["kv_transfer_params"]
    assert params["tpusync_kv_layout"]["format"] == "k-v"   # the reference engine's, in vLLM's dialect
    refused, pulled = server.metric(REFUSED), server.metric(PULLED)
    logged = server.log_path.read_text(errors="replace").count("holds other KV")
    resp = server.complete(p, max_tokens=8, kv_transfer_params=params)
    # vLLM alone, after: before, its own prefix cache would hold the prompt and nothing be offered
    assert resp["choices"][0]["token_ids"] == server.complete(p, max_tokens=8)["choices"][0]["token_ids"]
    assert server.metric(REFUSED) == refused + 1 and server.metric(PULLED) == pulled
    log = server.log_path.read_text(errors="replace")
    assert log.count("holds other KV") == logged + 1, server.log_tail()
    assert "format 'k-v', here 'vllm-torch'" in log, server.log_tail()
    assert "kv_transfer_params." not in log  # read whole: no field malformed to vLLM's parser


def test_a_vllm_prefills_hand_off_to_the_reference_engine_is_read_and_refused_by_the_layout_check(engines):
    server, ref, log = engines["vllm"], engines["decode"], engines["logs"]["decode"]
    p = prompt(71, TOKENS, vocab=engines["vocab"])
    want = post(ref.url, {"prompt": p, "max_tokens": 8})["choices"][0]["token_ids"]
    params = server.complete(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert params["tpusync_kv_layout"]["format"] == "vllm-torch"
    refused, pulled = ref_metric(ref.url, REFUSED), ref_metric(ref.url, PULLED)
    got = post(ref.url, {"prompt": p, "max_tokens": 8, "kv_transfer_params": params})
    assert got["choices"][0]["token_ids"] == want
    assert ref_metric(ref.url, REFUSED) == refused + 1 and ref_metric(ref.url, PULLED) == pulled
    text = log.read_text(errors="replace")
    assert "not pulling the prefill's KV" in text and "format 'vllm-torch', here 'k-v'" in text, text[-3000:]
    assert "kv_transfer_params." not in text  # read whole: no field malformed to the reference parser
