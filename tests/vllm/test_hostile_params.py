"""kv_transfer_params are a field any client may set in a completion request. vLLM's OpenAI server
(the engine core in a process of its own, as deployed) with tpusync's connector meets malformed
ones: each request is answered with the tokens vLLM computes alone, the connector logs one
warning naming the field, nothing is pulled from anywhere the request named, and the engine keeps
serving: the next well-formed P/D request still pulls its blocks from the prefill pod's sidecar.

Engines of their own (a prefill engine and the server under test, each on its own sidecar), so a
request that stops the server cannot take the session's shared engines with it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.request
import uuid

import pytest

from harness.engines import EngineSpec, prompt
from harness.tinymodel import BLOCK_BYTES, BLOCK_SIZE, build
from tpusync.local import sidecars as sidecar_mod
from tpusync.local.sidecars import write_secret

HITS = "vllm:external_prefix_cache_hits_total"  # prompt tokens a KV connector supplied
REFUSED = "tpusync_kv_refused_handoffs_total"  # tpusync.kv.path_metrics
TOKENS = 300  # 9 full blocks
SECRET = b"vllm-hostile-params-secret-0123456789"


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """prefill: the offline engine, kv_producer on sidecar hp (advertises its data port);
    server: vLLM's API server, kv_both on sidecar hd (pulls as a decode engine, answers
    do_remote_decode as a prefill engine)."""
    work = tmp_path_factory.mktemp("hostile")
    secret = write_secret(work / "secret", SECRET + b"\n")
    with contextlib.ExitStack() as stack:
        sidecars = {}
        for name in ("hp", "hd"):
            pool = f"/dev/shm/tpusync-vllm-{os.getpid()}-{name}-{uuid.uuid4().hex[:6]}"
            stack.callback(_remove, pool)
            sidecars[name] = stack.enter_context(sidecar_mod.launch(
                pool_path=pool, secret_file=secret, dram_bytes=32 << 20, block_bytes=BLOCK_BYTES,
                control_socket=str(work / f"{name}.sock"), stderr=subprocess.DEVNULL))
        base = EngineSpec(str(build(work / "model")), work)
        prefill = base.connector("kv_producer", control_socket=sidecars["hp"].control_socket,
                                 data_address=sidecars["hp"].address).start("hostile-prefill")
        stack.callback(prefill.stop)
        server = base.connector("kv_both", control_socket=sidecars["hd"].control_socket,
                                data_address=sidecars["hd"].address).serve("hostile-server")
        stack.callback(server.stop)
        prefill.wait_ready()
        server.wait_ready()
        yield {"prefill": prefill, "server": server, **sidecars}


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _prefilled(pd, seed: int) -> tuple[list[int], list[int], dict]:
    """A prompt, the tokens vLLM alone gives it, and the prefill engine's kv_transfer_params for
    it (its blocks are in sidecar hp)."""
    p = prompt(seed, TOKENS)
    want = pd["prefill"].generate(p, max_tokens=16)["token_ids"]
    params = pd["prefill"].generate(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return p, want, params["kv_transfer_params"]


def _mentions(server, text: str) -> int:
    return server.log_path.read_text(errors="replace").count(text)


# (what the client sends on top of the prefill's well-formed params, the field the refusal names)
MALFORMED = [
    ({"remote_port": "x"}, "remote_port"),
    ({"remote_port": [7600]}, "remote_port"),
    ({"tpusync_last_key": "zz"}, "tpusync_last_key"),
    ({"tpusync_block_size": "32"}, "tpusync_block_size"),
    ({"remote_num_tokens": {"n": 1}}, "remote_num_tokens"),
    ({"tpusync_kv_layout": [1, 2]}, "tpusync_kv_layout"),
    ({"tpusync_kv_layout": {"shards": "1"}}, "tpusync_kv_layout.shards"),
    ({"remote_addresses": "127.0.0.1:1"}, "remote_addresses"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ({"remote_host": "localhost"}, "remote_host"),  # a name: the sidecar would resolve it for the client
]


@pytest.mark.parametrize(("change", "field"), MALFORMED, ids=[f for _, f in MALFORMED])
def test_a_malformed_field_is_refused_and_the_prompt_computed(pd, change, field):
    server = pd["server"]
    p, want, params = _prefilled(pd, 900 + MALFORMED.index((change, field)))
    hits, logged = server.metric(HITS), _mentions(server, f"kv_transfer_params.{field} is ")
    refused = server.metric(REFUSED)
    resp = server.complete(p, max_tokens=16, kv_transfer_params={**params, **change})
    assert resp["choices"][0]["token_ids"] == want
    assert server.metric(HITS) == hits  # nothing loaded from what the request named
    assert server.metric(REFUSED) == refused + 1  # counted where the operator reads it (status.kvPath)
    assert _mentions(server, f"kv_transfer_params.{field} is ") == logged + 1, server.log_tail()


def test_a_malformed_do_remote_decode_returns_no_params(pd):
    server = pd["server"]
    p = prompt(950, TOKENS)
    logged = _mentions(server, "kv_transfer_params.do_remote_decode is ")
    resp = server.complete(p, max_tokens=1, kv_transfer_params={"do_remote_decode": "yes"})
    assert len(resp["choices"][0]["token_ids"]) == 1 and resp.get("kv_transfer_params") is None
    assert _mentions(server, "kv_transfer_params.do_remote_decode is ") == logged + 1


def test_the_engine_keeps_serving_and_the_next_well_formed_request_pulls(pd):
    server = pd["server"]
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as r:
        assert r.status == 200
    p, want, params = _prefilled(pd, 960)
    hits = server.metric(HITS)
    resp = server.complete(p, max_tokens=16, kv_transfer_params=params)
    assert resp["choices"][0]["token_ids"] == want
    assert server.metric(HITS) - hits == TOKENS // BLOCK_SIZE * BLOCK_SIZE
