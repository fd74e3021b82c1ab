"""The HTTP front end in-process: what it answers when the engine fails, and its options."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from tpusync.engines.reference.engine import Engine
from tpusync.engines.reference.model import ModelConfig
from tpusync.engines.reference.server import CompletionServer

CFG = ModelConfig(max_seq=1024, layers=2, d_model=128, mlp=256)


@pytest.fixture
def failing_server():
    """A server whose engine fails every request with a socket error naming a peer."""
    engine = Engine(CFG)

    def generate(*args: object, **kwargs: object) -> None:
        raise ConnectionRefusedError("connection refused 10.0.0.5:9400")

    engine.generate = generate
    server = CompletionServer(("127.0.0.1", 0), engine, "m")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_is_answered_without_its_text(failing_server, stream, caplog):
    conn = http.client.HTTPConnection("127.0.0.1", failing_server.server_address[1], timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "stream": stream}))
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    assert resp.status == (200 if stream else 500)  # a stream has sent its 200 before generating
    assert "internal error" in body
    assert "10.0.0.5" not in body and "refused" not in body
    assert "10.0.0.5:9400" in caplog.text  # logged, with its traceback


@pytest.mark.parametrize("option", ["max_body_bytes", "max_prompt_tokens"])
def test_the_caps_must_be_positive(option):
    with pytest.raises(ValueError, match=option):
        CompletionServer(("127.0.0.1", 0), Engine(CFG), "m", **{option: 0})


def test_the_caps_default_to_the_models_length():
    server = CompletionServer(("127.0.0.1", 0), Engine(CFG), "m")
    try:
        assert server.max_prompt_tokens == CFG.max_seq
        assert server.max_body_bytes == 1 << 20  # 16 bytes a token would be less
    finally:
        server.server_close()
    big = ModelConfig(max_seq=131072, layers=1, d_model=64, mlp=64, heads=2, kv_heads=1, head_dim=32)
    server = CompletionServer(("127.0.0.1", 0), Engine(big), "m")
    try:
        assert server.max_prompt_tokens == 131072 and server.max_body_bytes == 16 * 131072
    finally:
        server.server_close()
