"""A connector that switches itself off says so where the operator reads it.

vLLM's API server beside a sidecar whose blocks are smaller than one of the engine's KV blocks:
the connector cannot store a block, stays off (one log line) and passes every request through,
and the engine answers as if it had no connector. Before, nothing but that line told; now the
server's /metrics carries tpusync_kv_connector_off{reason="store-blocks-too-small"} 1
(tpusync.kv.path_metrics), which the operator turns into KVPath=False, ConnectorOff
(tpusync_operator.kv_path, tests/unit/operator/test_operator_kv_path.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.request
import uuid

import pytest

from harness.engines import EngineSpec, prompt
from harness.tinymodel import BLOCK_BYTES, build
from tpusync.local import sidecars as sidecar_mod
from tpusync.local.sidecars import write_secret

OFF = "tpusync_kv_connector_off"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("off")
    secret = write_secret(work / "secret", b"vllm-connector-off-0123456789abcdef\n")
    pool = f"/dev/shm/tpusync-vllm-{os.getpid()}-off-{uuid.uuid4().hex[:6]}"
    small = 4096
    assert small < BLOCK_BYTES
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: os.path.exists(pool) and os.unlink(pool))
        car = stack.enter_context(sidecar_mod.launch(
            pool_path=pool, secret_file=secret, dram_bytes=8 << 20, block_bytes=small,
            control_socket=str(work / "off.sock"), stderr=subprocess.DEVNULL))
        api = EngineSpec(str(build(work / "model")), work).connector(
            "kv_both", control_socket=car.control_socket, data_address=car.address).serve("connector-off")
        stack.callback(api.stop)
        yield api.wait_ready()


def test_blocks_too_small_switch_the_connector_off_and_metrics_say_why(server):
    out = server.complete(prompt(80, 100), max_tokens=4)
    assert len(out["choices"][0]["token_ids"]) == 4   # served all the same: the path is silent to clients
    log = server.log_path.read_text(errors="replace")
    assert "the connector stays off" in log, server.log_tail()
    text = metrics_text(server)
    off = [line for line in text.splitlines() if line.startswith(OFF + "{")]
    assert any('reason="store-blocks-too-small"' in line and line.endswith(" 1.0") for line in off), off
    assert all(line.endswith(" 0.0") for line in off if 'reason="store-blocks-too-small"' not in line), off


def metrics_text(server) -> str:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        return r.read().decode()
