"""Real server processes over real sockets: what a broken or hostile client sends gets an
answer and leaves the connection in step; the body and prompt caps hold on every route; a
block the store holds with the wrong length is a miss; no peer's socket error reaches a client.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest

import tpusync
from tests.integration.serving.requests import post
from tests.integration.serving.stack import ServingStack
from tpusync.engines.reference.model import ModelConfig
from tpusync.kv.keys import BlockHasher
from tpusync.local.servers import start_server

MODEL = {"max_seq": 1024, "layers": 2, "d_model": 128, "mlp": 256}
CFG = ModelConfig(**MODEL)
BLOCK = -(-CFG.page_bytes // 4096) * 4096


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A server without a store (`mono`, the reference tokens), one over a sidecar (`cached`)
    whose log the tests read, and a prefill server on a sidecar of its own (`prefill`)."""
    stack = ServingStack(tmp_path_factory.mktemp("hardening"), BLOCK)
    log_path = stack.work / "cached.log"
    try:
        with open(log_path, "w") as log:
            side, p_side = stack.sidecar("side"), stack.sidecar("p_side")
            stack.add("mono", start_server("both", model_config=MODEL, prefix_cache=False))
            stack.add("cached", start_server("both", model_config=MODEL, control_socket=side.control_socket,
                                             data_address=side.address, stderr=log))
            stack.add("prefill", start_server("prefill", model_config=MODEL, control_socket=p_side.control_socket,
                                              data_address=p_side.address, stderr=subprocess.DEVNULL))
        yield stack.running | {"log": log_path}
    finally:
        stack.close()


def post_raw(url: str, data: bytes, path: str = "/v1/completions") -> urllib.error.HTTPError:
    """POSTs `data` and returns the error response it must get."""
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120)
    return e.value


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def tokens(resp: dict) -> list[int]:
    return resp["choices"][0]["token_ids"]


class _Unclosable(io.BytesIO):
    def close(self) -> None:  # HTTPResponse closes its file after each response; the next follows in it
        pass


class _Recorded:
    """What a server sent, as a socket that http.client.HTTPResponse can parse responses from."""

    def __init__(self, data: bytes):
        self.file = _Unclosable(data)

    def makefile(self, *args: object, **kwargs: object) -> io.BytesIO:
        return self.file


def exchange(port: int, data: bytes) -> tuple[bytes, list[tuple[int, http.client.HTTPMessage, bytes]]]:
    """Sends raw bytes on one connection and reads until the server closes it: a server that
    never answers, or keeps the connection open, fails this with a timeout. Returns what came
    back and the responses in it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    recorded, responses = _Recorded(raw), []
    while recorded.file.tell() < len(raw):
        r = http.client.HTTPResponse(recorded)
        r.begin()
        responses.append((r.status, r.headers, r.read()))
    return raw, responses


# -- request framing -------------------------------------------------------------------------


@pytest.mark.parametrize("method, path", [("POST", "/v1/no-such-route"), ("GET", "/health"), ("GET", "/nowhere")])
def test_a_body_is_never_read_as_the_next_request(servers, method, path):
    """A body the route ignores is consumed (or the connection closed): never parsed as a request."""
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    first = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(smuggled)}\r\n\r\n".encode() + smuggled
    second = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    _, responses = exchange(servers["mono"].port, first + second)
    assert len(responses) == 2  # not three: /health's answer to the body would come between
    status, _, body = responses[-1]
    assert status == 200 and json.loads(body)["data"][0]["max_model_len"] == CFG.max_seq


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/completions/render"])
@pytest.mark.parametrize("body, message", [
    (b"[1, 2]", "a JSON object, not a list"), (b'"x"', "a JSON object, not a string"),
    (b"3", "a JSON object, not a number"), (b"null", "a JSON object, not null"),
    (b"[" * 100_000, "nested too deeply"),
])
def test_a_body_that_is_not_a_json_object_gets_a_400(servers, path, body, message):
    conn = http.client.HTTPConnection("127.0.0.1", servers["mono"].port, timeout=30)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and message in json.loads(resp.read())["error"]["message"]
    conn.request("GET", "/health")  # the connection is still in step
    assert conn.getresponse().status == 200
    conn.close()


@pytest.mark.parametrize("headers, status, names", [
    (["Content-Length: -1"], 400, "Content-Length"),
    (["Content-Length: abc"], 400, "Content-Length"),
    (["Content-Length: +5"], 400, "Content-Length"),
    (["Content-Length: 5", "Content-Length: 6"], 400, "Content-Length"),
    (["Content-Length: 99999999999999999999"], 413, "bytes"),
    (["Content-Length: " + "9" * 5000], 413, "bytes"),     # more digits than int() takes
    (["Content-Length: 4194304"], 413, "bytes"),           # over the 1 MiB cap: refused before it is sent
    (["Transfer-Encoding: chunked"], 411, "Content-Length"),
    (["Content-Length: 4194304", "Expect: 100-continue"], 413, "bytes"),  # no 100 Continue first
])
def test_a_bad_content_length_gets_an_answer_and_the_connection_closes(servers, headers, status, names):
    head = "\r\n".join(["POST /v1/completions HTTP/1.1", "Host: x", "Content-Type: application/json", *headers])
    body = b"5\r\n{\"a\":\r\n0\r\n\r\n" if "chunked" in headers[0] else b""
    raw, responses = exchange(servers["mono"].port, head.encode() + b"\r\n\r\n" + body)
    assert raw.startswith(f"HTTP/1.1 {status} ".encode())
    assert len(responses) == 1  # nothing after it: the connection closed
    got, got_headers, got_body = responses[0]
    assert got == status and got_headers["Connection"] == "close"
    assert names in json.loads(got_body)["error"]["message"]


# -- caps ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/completions/render"])
def test_a_4_mib_body_is_refused_before_it_is_read(servers, path):
    e = post_raw(servers["mono"].url, json.dumps({"prompt": "a" * (4 << 20)}).encode(), path)
    assert e.code == 413 and "bytes" in json.load(e)["error"]["message"]


@pytest.mark.parametrize("path, too_long", [
    *[(path, too_long) for path in ("/v1/completions", "/v1/completions/render") for too_long in (
        "a" * (CFG.max_seq + 1), [7] * (CFG.max_seq + 1),
        "€" * (CFG.max_seq // 3 + 1),                  # fewer characters than the cap, 3 tokens each
    )],
    ("/v1/completions/render", ["ok", "a" * 2000]),       # one of several render prompts
])
def test_a_prompt_over_the_models_length_is_refused_on_every_route(servers, path, too_long):
    e = post_raw(servers["mono"].url, json.dumps({"prompt": too_long, "max_tokens": 1}).encode(), path)
    assert e.code == 400 and f"at most {CFG.max_seq} tokens" in json.load(e)["error"]["message"]


def test_render_takes_a_prompt_of_the_models_length(servers):
    full = post(servers["mono"].url, {"prompt": "a" * CFG.max_seq}, "/v1/completions/render")
    assert full == [{"token_ids": [97] * CFG.max_seq}]


def test_the_flags_set_the_caps():
    server = start_server("both", model_config=MODEL, prefix_cache=False,
                          extra_args=["--no-warm-up", "--max-body-bytes", "2048", "--max-prompt-tokens", "50"])
    try:
        ok = post(server.url, {"prompt": [1] * 50}, "/v1/completions/render")
        assert ok == [{"token_ids": [1] * 50}]
        e = post_raw(server.url, json.dumps({"prompt": [1] * 51}).encode(), "/v1/completions/render")
        assert e.code == 400 and "at most 50 tokens" in json.load(e)["error"]["message"]
        e = post_raw(server.url, json.dumps({"prompt": "a" * 2048}).encode(), "/v1/completions/render")
        assert e.code == 413 and "2048 bytes" in json.load(e)["error"]["message"]
    finally:
        server.stop()


# -- the store and peers ---------------------------------------------------------------------


def test_a_block_of_the_wrong_length_is_a_miss_and_is_replaced(servers):
    """A block shorter than a page under a prompt's first key: recomputed, never a 500, and the
    page computed then is what the next request loads."""
    p = prompt(21, 300)
    want = tokens(post(servers["mono"].url, {"prompt": p, "max_tokens": 8}))
    first_key = BlockHasher(CFG.page_size, "tpusync").keys(p)[0]
    with tpusync.KVStore.connect(f"unix://{servers['side'].control_socket}") as store:
        store.put([first_key], [np.ones(100, np.uint8)])
        r = post(servers["cached"].url, {"prompt": p, "max_tokens": 8})
        assert tokens(r) == want and r["tpusync"]["cached_tokens"] == 0
        with store.acquire_many([first_key]) as views:
            assert views[0] is not None and len(views[0]) == CFG.page_bytes
        again = post(servers["cached"].url, {"prompt": p, "max_tokens": 8})
    assert tokens(again) == want
    assert again["tpusync"]["cached_tokens"] == 300 // CFG.page_size * CFG.page_size // CFG.chunk * CFG.chunk


def test_a_dead_peers_error_stays_in_the_servers_log(servers):
    p = prompt(22, 200)
    want = tokens(post(servers["mono"].url, {"prompt": p, "max_tokens": 6}))
    dead = "127.0.0.1:1"  # nothing listens there
    body = {"prompt": p, "max_tokens": 6,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1}}
    r = post(servers["cached"].url, body)
    assert tokens(r) == want and r["tpusync"]["prefix_cache"] == "unavailable"
    assert dead not in json.dumps(r) and "store_error" not in r["tpusync"]
    # A prompt this host lacks (it holds p now), so the dead peer is asked again.
    streamed = {**body, "prompt": prompt(24, 200), "stream": True}
    req = urllib.request.Request(servers["cached"].url + "/v1/completions", data=json.dumps(streamed).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        stream = resp.read().decode()
    assert '"prefix_cache": "unavailable"' in stream and dead not in stream
    assert dead in servers["log"].read_text()  # the operator still learns why


@pytest.mark.parametrize("host, port, marker", [
    ("a" * 300, 9400, "a" * 12), ("127.0.0.1\r\nX-Injected: 1", 1, "X-Injected"), ("127.0.0.1:1", 1, "127.0.0.1"),
    ("127.0.0.1", 99999, "127.0.0.1"), ("host:port", 9400, "host:port"), (12345, 1, None),
    (["127.0.0.1"], 1, "127.0.0.1"),
])
def test_a_malformed_remote_address_is_ignored_not_passed_on(servers, host, port, marker):
    p = prompt(23, 200)
    want = tokens(post(servers["mono"].url, {"prompt": p, "max_tokens": 4}))
    line = f"kv_transfer_params.{'remote_port' if port == 99999 else 'remote_host'} is "
    logged = servers["log"].read_text().count(line)
    params = {"do_remote_prefill": True, "remote_host": host, "remote_port": port}
    r = post(servers["cached"].url, {"prompt": p, "max_tokens": 4, "kv_transfer_params": params})
    # Not passed to the sidecar: no pull was tried, so none failed.
    assert tokens(r) == want and r["tpusync"]["prefix_cache"] == "ok"
    assert marker is None or marker not in json.dumps(r)
    assert servers["log"].read_text().count(line) == logged + 1  # logged before the response was sent


# (what a client sends on top of the prefill server's well-formed kv_transfer_params, the field
# the refusal names): each would have the sidecar pull, or pull from what the client chose.
MALFORMED = [
    ({"remote_host": "localhost"}, "remote_host"),  # a name: the sidecar would resolve it
    ({"remote_port": "{port}"}, "remote_port"),
    ({"remote_addresses": "127.0.0.1:{port}"}, "remote_addresses"),
    ({"remote_addresses": ["127.0.0.1:1\r\nX-Injected: 1"]}, "remote_addresses[0]"),
    ({"tpusync_kv_layout": {"hosts": [[7]]}}, "tpusync_kv_layout.hosts[0]"),
    ({"tpusync_kv_layout": {"head_size": "32"}}, "tpusync_kv_layout.head_size"),
    ({"tpusync_kv_layout": {"shards": True}}, "tpusync_kv_layout.shards"),
    ({"tpusync_last_key": "zz"}, "tpusync_last_key"),
    ({"remote_num_tokens": "x"}, "remote_num_tokens"),
    ({"tpusync_block_size": [32]}, "tpusync_block_size"),
]


def _malformed(params: dict, change: dict, port: int) -> dict:
    """`params` with `change` ({port}: the prefill's sidecar's data port; a layout's fields merged)."""
    change = json.loads(json.dumps(change).replace("{port}", str(port)))
    layout = "tpusync_kv_layout"
    return {**params, **change, **({layout: {**params[layout], **change[layout]}} if layout in change else {})}


@pytest.mark.parametrize(("change", "field"), MALFORMED, ids=[f for _, f in MALFORMED])
def test_malformed_kv_transfer_params_are_refused_and_the_prompt_computed(servers, change, field):
    """Refused whole, with one line in the server's log naming the request and the field: nothing
    is pulled (the sidecar is asked nothing), and the answer is the monolithic server's."""
    p = prompt(300 + MALFORMED.index((change, field)), 300)
    want = tokens(post(servers["mono"].url, {"prompt": p, "max_tokens": 6}))
    params = post(servers["prefill"].url, {"prompt": p, "max_tokens": 1})["kv_transfer_params"]
    line = f"kv_transfer_params.{field} is "
    logged = servers["log"].read_text().count(line)
    r = post(servers["cached"].url, {"prompt": p, "max_tokens": 6,
                                     "kv_transfer_params": _malformed(params, change, servers["p_side"].data_port)})
    assert tokens(r) == want
    assert r["tpusync"]["pulled_blocks"] == 0 and r["tpusync"]["prefix_cache"] == "ok"
    log = servers["log"].read_text()
    assert log.count(line) == logged + 1
    assert r["id"] in next(row for row in reversed(log.splitlines()) if line in row)


def test_after_malformed_params_a_well_formed_hand_off_still_pulls(servers):
    p = prompt(399, 300)
    want = tokens(post(servers["mono"].url, {"prompt": p, "max_tokens": 6}))
    params = post(servers["prefill"].url, {"prompt": p, "max_tokens": 1})["kv_transfer_params"]
    r = post(servers["cached"].url, {"prompt": p, "max_tokens": 6, "kv_transfer_params": params})
    assert tokens(r) == want and r["tpusync"]["pulled_blocks"] == 300 // CFG.page_size


def test_sigterm_finishes_the_request_in_flight_then_exits():
    """SIGTERM (the kubelet's stop, after the pod's preStop drain): the server takes no new
    connection, answers the request it is streaming to its end, then exits 0. Before, the
    default SIGTERM cut the stream (outside a container), or was ignored by the container's
    PID 1 until the grace period's SIGKILL cut it."""
    server = start_server("both", model_config=MODEL, prefix_cache=False, stderr=subprocess.DEVNULL)
    try:
        max_tokens = 96
        body = json.dumps({"prompt": prompt(40, 64), "max_tokens": max_tokens, "stream": True}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = resp.readline()
        assert first.startswith(b"data: "), first
        server.process.terminate()                 # SIGTERM while the answer streams
        rest = resp.read().decode()
        chunks = [json.loads(line[6:]) for line in [first.decode().strip(), *rest.splitlines()]
                  if line.startswith("data: ") and line != "data: [DONE]"]
        tokens = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
        assert len(tokens) == max_tokens and rest.rstrip().endswith("data: [DONE]"), rest[-500:]
        assert server.process.wait(timeout=60) == 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=5)
    finally:
        server.stop()
