"""Contract test of tpusync_operator.gke.GKEClient.

This is a contract test against the *documented* GKE REST API (container.googleapis.com
v1: projects.locations.clusters.nodePools create/get/delete, projects.locations.operations
get, Google JSON error bodies), served by a small local HTTP server on 127.0.0.1 written
from that documentation. It is not GKE: it checks that our client speaks the documented
contract (paths, bearer auth, long-running operations, 409/429/5xx/401/403 handling),
not how GKE itself behaves.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from op_helpers import PoolBody
from tpusync_operator.builders.common import Owner
from tpusync_operator.builders.pool import build_node_pool_request
from tpusync_operator.gke import (ClusterRef, GKEAuthError, GKEClient, GKEConflict, GKEError, GKETransientError,
                                  MetadataServerToken, StaticToken)
from tpusync_operator.models import TPUSyncPoolSpec
from tpusync_operator.tpu import slice_for

PARENT = "/v1/projects/proj/locations/us-central1/clusters/c1"
OPS = "/v1/projects/proj/locations/us-central1/operations/"
CLUSTER = ClusterRef("proj", "us-central1", "c1")


class FakeGKEState:
    def __init__(self):
        self.lock = threading.Lock()
        self.pools: dict[str, dict] = {}
        self.ops: dict[str, dict] = {}
        self.polls_until_done = 2
        self.faults: list[tuple[int, str, dict]] = []   # (status, google status, headers) served first
        self.tokens = {"good"}
        self.requests: list[tuple[str, str, str]] = []
        self.bodies: list[dict] = []
        self.seq = 0


def make_handler(state: FakeGKEState):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):   # keep pytest output clean
            pass

        def _send(self, code: int, body: dict, headers: dict | None = None):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, status: str, message: str, headers: dict | None = None):
            self._send(code, {"error": {"code": code, "message": message, "status": status}}, headers)

        def _op(self, op_type: str, target: str) -> dict:
            state.seq += 1
            op = {"name": f"operation-{state.seq}", "operationType": op_type, "status": "RUNNING",
                  "targetLink": target, "selfLink": OPS + f"operation-{state.seq}", "polls": 0}
            state.ops[op["name"]] = op
            return {k: v for k, v in op.items() if k != "polls"}

        def _handle(self, method: str):
            with state.lock:
                auth = self.headers.get("Authorization", "")
                state.requests.append((method, self.path, auth))
                if state.faults:
                    code, status, headers = state.faults.pop(0)
                    return self._error(code, status, f"injected {code}", headers)
                if not auth.startswith("Bearer ") or auth[7:] not in state.tokens:
                    return self._error(401, "UNAUTHENTICATED", "Request had invalid authentication credentials.")
                path = self.path
                if path.startswith(OPS) and method == "GET":
                    op = state.ops.get(path[len(OPS):])
                    if op is None:
                        return self._error(404, "NOT_FOUND", "operation not found")
                    op["polls"] += 1
                    if op["polls"] >= state.polls_until_done and op["status"] != "DONE":
                        op["status"] = "DONE"
                        name = op["targetLink"].rsplit("/", 1)[-1]
                        if op["operationType"] == "CREATE_NODE_POOL":
                            state.pools[name]["status"] = "RUNNING"
                        else:
                            state.pools.pop(name, None)
                    return self._send(200, {k: v for k, v in op.items() if k != "polls"})
                if path == PARENT + "/nodePools" and method == "POST":
                    length = int(self.headers.get("Content-Length", "0"))
                    body = json.loads(self.rfile.read(length) or b"{}")
                    state.bodies.append(body)
                    np = body.get("nodePool") or {}
                    if not np.get("name") or "machineType" not in np.get("config", {}):
                        return self._error(400, "INVALID_ARGUMENT", "nodePool.name and config.machineType required")
                    if np["name"] in state.pools:
                        return self._error(409, "ALREADY_EXISTS", f"Already exists: {np['name']}")
                    state.pools[np["name"]] = {**np, "status": "PROVISIONING"}
                    return self._send(200, self._op("CREATE_NODE_POOL", f"{PARENT}/nodePools/{np['name']}"))
                if path.startswith(PARENT + "/nodePools/"):
                    name = path.rsplit("/", 1)[-1]
                    if name not in state.pools:
                        return self._error(404, "NOT_FOUND", f"Not found: {name}")
                    if method == "GET":
                        return self._send(200, state.pools[name])
                    if method == "DELETE":
                        state.pools[name]["status"] = "STOPPING"
                        return self._send(200, self._op("DELETE_NODE_POOL", f"{PARENT}/nodePools/{name}"))
                return self._error(404, "NOT_FOUND", f"no route for {method} {path}")

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

        def do_DELETE(self):
            self._handle("DELETE")

    return Handler


@pytest.fixture
def server():
    state = FakeGKEState()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


class Sleeps:
    """Records backoff delays instead of sleeping (the server answers synchronously)."""

    def __init__(self):
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def request_body():
    body = PoolBody().v7x("2x2x2").gke(workloadPolicy="wp").build()
    spec = TPUSyncPoolSpec.model_validate(body["spec"])
    return build_node_pool_request(Owner.from_body(body), spec, slice_for("v7x", "2x2x2"))


def run(coro):
    return asyncio.run(coro)


def test_create_poll_get_delete(server):
    state, url = server

    async def scenario():
        client = GKEClient(StaticToken("good"), url, sleep=Sleeps())
        try:
            op = await client.create_node_pool(CLUSTER, request_body())
            assert op["status"] == "RUNNING" and op["operationType"] == "CREATE_NODE_POOL"
            assert (await client.get_node_pool(CLUSTER, "pool"))["status"] == "PROVISIONING"
            done = await client.wait_operation(CLUSTER, op["name"], interval=1)
            assert done["status"] == "DONE"
            np = await client.get_node_pool(CLUSTER, "pool")
            assert np["status"] == "RUNNING" and np["placementPolicy"] == {"type": "COMPACT", "policyName": "wp"}
            with pytest.raises(GKEConflict) as e:
                await client.create_node_pool(CLUSTER, request_body())
            assert e.value.status == 409 and e.value.reason == "ALREADY_EXISTS"
            op = await client.delete_node_pool(CLUSTER, "pool")
            assert op["operationType"] == "DELETE_NODE_POOL"
            await client.wait_operation(CLUSTER, op["name"], interval=1)
            assert await client.get_node_pool(CLUSTER, "pool") is None
            assert await client.delete_node_pool(CLUSTER, "pool") is None
        finally:
            await client.aclose()

    run(scenario())
    assert state.bodies[0]["nodePool"]["config"]["machineType"] == "tpu7x-standard-4t"
    assert all(auth == "Bearer good" for _, _, auth in state.requests)
    assert ("GET", OPS + "operation-1", "Bearer good") in state.requests


@pytest.mark.parametrize("code,status", [(429, "RESOURCE_EXHAUSTED"), (503, "UNAVAILABLE"), (500, "INTERNAL")])
def test_transient_errors_are_retried(server, code, status):
    state, url = server
    state.faults = [(code, status, {"Retry-After": "7"}), (code, status, {})]
    sleeps = Sleeps()

    async def scenario():
        client = GKEClient(StaticToken("good"), url, sleep=sleeps, retries=3)
        try:
            return await client.get_node_pool(CLUSTER, "absent")
        finally:
            await client.aclose()

    assert run(scenario()) is None          # third attempt reaches the server: 404 -> None
    assert sleeps.delays == [7.0, 2.0]      # Retry-After honoured, then exponential backoff
    assert len(state.requests) == 3


def test_transient_errors_give_up(server):
    state, url = server
    state.faults = [(503, "UNAVAILABLE", {})] * 3

    async def scenario():
        client = GKEClient(StaticToken("good"), url, sleep=Sleeps(), retries=2)
        try:
            await client.create_node_pool(CLUSTER, request_body())
        finally:
            await client.aclose()

    with pytest.raises(GKETransientError) as e:
        run(scenario())
    assert e.value.status == 503 and state.pools == {}


def test_forbidden_is_an_auth_error_without_retry(server):
    state, url = server
    state.faults = [(403, "PERMISSION_DENIED", {})]
    sleeps = Sleeps()

    async def scenario():
        client = GKEClient(StaticToken("good"), url, sleep=sleeps)
        try:
            await client.create_node_pool(CLUSTER, request_body())
        finally:
            await client.aclose()

    with pytest.raises(GKEAuthError) as e:
        run(scenario())
    assert e.value.status == 403 and e.value.reason == "PERMISSION_DENIED" and sleeps.delays == []


class RotatingToken:
    """First token is stale; a refresh returns a valid one."""

    def __init__(self):
        self.refreshes = 0

    async def token(self, *, refresh: bool = False) -> str:
        if refresh:
            self.refreshes += 1
        return "good" if self.refreshes else "stale"


def test_401_refreshes_the_token_once(server):
    state, url = server
    tokens = RotatingToken()

    async def scenario():
        client = GKEClient(tokens, url, sleep=Sleeps())
        try:
            return await client.get_node_pool(CLUSTER, "absent")
        finally:
            await client.aclose()

    assert run(scenario()) is None
    assert tokens.refreshes == 1
    assert [a for _, _, a in state.requests] == ["Bearer stale", "Bearer good"]


def test_401_twice_is_an_auth_error(server):
    state, url = server
    state.tokens = set()

    async def scenario():
        client = GKEClient(StaticToken("nope"), url, sleep=Sleeps())
        try:
            await client.get_node_pool(CLUSTER, "x")
        finally:
            await client.aclose()

    with pytest.raises(GKEAuthError) as e:
        run(scenario())
    assert e.value.status == 401 and len(state.requests) == 2


def test_bad_request_is_not_retried(server):
    state, url = server

    async def scenario():
        client = GKEClient(StaticToken("good"), url, sleep=Sleeps())
        try:
            await client.create_node_pool(CLUSTER, {"nodePool": {"name": "x", "config": {}}})
        finally:
            await client.aclose()

    with pytest.raises(GKEError) as e:
        run(scenario())
    assert e.value.status == 400 and not isinstance(e.value, (GKETransientError, GKEAuthError))
    assert len(state.requests) == 1


def test_metadata_server_token_is_cached_until_expiry():
    """The metadata-server token endpoint (Workload Identity), served by httpx.MockTransport."""
    calls = []
    now = [1000.0]

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        assert request.headers["Metadata-Flavor"] == "Google"
        assert request.url.path == "/computeMetadata/v1/instance/service-accounts/default/token"
        return httpx.Response(200, json={"access_token": f"t{len(calls)}", "expires_in": 3600,
                                         "token_type": "Bearer"})

    async def scenario():
        tokens = MetadataServerToken("http://metadata.test", transport=httpx.MockTransport(handler),
                                     clock=lambda: now[0])
        try:
            assert await tokens.token() == "t1"
            now[0] += 3000
            assert await tokens.token() == "t1"          # still valid
            now[0] += 600                                # within 60 s of expiry
            assert await tokens.token() == "t2"
            assert await tokens.token(refresh=True) == "t3"
        finally:
            await tokens.aclose()

    run(scenario())
    assert len(calls) == 3
