"""Contract test of tpusync_operator.gke.GKEClient.

This is a contract test against the *documented* GKE REST API (container.googleapis.com
v1: projects.locations.clusters.nodePools create/get/delete, projects.locations.operations
get, Google JSON error bodies), served by a small local HTTP server on 127.0.0.1 written
from that documentation (harness/gke_api.py; setSize / setAutoscaling are exercised by
test_operator_gke_resize.py). It is not GKE: it checks that our client speaks the documented
contract (paths, bearer auth, long-running operations, 409/429/5xx/401/403 handling),
not how GKE itself behaves.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from op_helpers import PoolBody

from harness.gke_api import OPS
from tpusync_operator.builders.common import Owner
from tpusync_operator.builders.pool import build_node_pool_request
from tpusync_operator.gke import (
    ClusterRef,
    GKEAuthError,
    GKEClient,
    GKEConflict,
    GKEError,
    GKETransientError,
    MetadataServerToken,
    StaticToken,
)
from tpusync_operator.models import TPUSyncPoolSpec
from tpusync_operator.tpu import slice_for

CLUSTER = ClusterRef("my-project", "us-central1", "c1")


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


def one_call(url, call, token=None, **client_kw):
    """`call(client)` on a GKEClient of its own (token "good", no real sleeps unless given),
    closed afterwards; returns what the call returned."""
    async def scenario():
        client = GKEClient(token or StaticToken("good"), url, **{"sleep": Sleeps(), **client_kw})
        try:
            return await call(client)
        finally:
            await client.aclose()

    return run(scenario())


def test_create_poll_get_delete(gke_server):
    state, url = gke_server

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
def test_transient_errors_are_retried(gke_server, code, status):
    state, url = gke_server
    state.faults = [(code, status, {"Retry-After": "7"}), (code, status, {})]
    sleeps = Sleeps()

    # the third attempt reaches the server: 404 -> None
    assert one_call(url, lambda client: client.get_node_pool(CLUSTER, "absent"), sleep=sleeps, retries=3) is None
    assert sleeps.delays == [7.0, 2.0]      # Retry-After honoured, then exponential backoff
    assert len(state.requests) == 3


def test_transient_errors_give_up(gke_server):
    state, url = gke_server
    state.faults = [(503, "UNAVAILABLE", {})] * 3

    with pytest.raises(GKETransientError) as e:
        one_call(url, lambda client: client.create_node_pool(CLUSTER, request_body()), retries=2)
    assert e.value.status == 503 and state.pools == {}


def test_forbidden_is_an_auth_error_without_retry(gke_server):
    state, url = gke_server
    state.faults = [(403, "PERMISSION_DENIED", {})]
    sleeps = Sleeps()

    with pytest.raises(GKEAuthError) as e:
        one_call(url, lambda client: client.create_node_pool(CLUSTER, request_body()), sleep=sleeps)
    assert e.value.status == 403 and e.value.reason == "PERMISSION_DENIED" and sleeps.delays == []


class RotatingToken:
    """First token is stale; a refresh returns a valid one."""

    def __init__(self):
        self.refreshes = 0

    async def token(self, *, refresh: bool = False) -> str:
        if refresh:
            self.refreshes += 1
        return "good" if self.refreshes else "stale"


def test_401_refreshes_the_token_once(gke_server):
    state, url = gke_server
    tokens = RotatingToken()

    assert one_call(url, lambda client: client.get_node_pool(CLUSTER, "absent"), token=tokens) is None
    assert tokens.refreshes == 1
    assert [a for _, _, a in state.requests] == ["Bearer stale", "Bearer good"]


def test_401_twice_is_an_auth_error(gke_server):
    state, url = gke_server
    state.tokens = set()

    with pytest.raises(GKEAuthError) as e:
        one_call(url, lambda client: client.get_node_pool(CLUSTER, "x"), token=StaticToken("nope"))
    assert e.value.status == 401 and len(state.requests) == 2


def test_bad_request_is_not_retried(gke_server):
    state, url = gke_server

    with pytest.raises(GKEError) as e:
        one_call(url, lambda client: client.create_node_pool(CLUSTER, {"nodePool": {"name": "x", "config": {}}}))
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


def test_a_body_the_published_schema_refuses_is_refused(gke_server):
    """The server holds bodies against the container v1 discovery document (gke_schema.py):
    what our builders send passes (test_create_poll_get_delete); a misspelt field does not."""
    state, url = gke_server
    bad = request_body()
    bad["nodePool"]["config"]["machinetype"] = bad["nodePool"]["config"].pop("machineType")

    async def scenario():
        client = GKEClient(StaticToken("good"), url, sleep=Sleeps())
        try:
            with pytest.raises(GKEError) as e:
                await client.create_node_pool(CLUSTER, bad)
            assert e.value.status == 400 and e.value.reason == "INVALID_ARGUMENT"
            assert "unknown field 'machinetype'" in e.value.message
            assert state.pools == {}
        finally:
            await client.aclose()
    run(scenario())
