"""ApiKube (the thin API-server client) against a local HTTP server that records requests:
server-side apply wire format, paths, discovery of optional CRDs, error mapping."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import ThreadingHTTPServer

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from harness.json_http import JsonHandler
from tpusync_operator.kube import ApiKube, KubeError, path
from tpusync_operator.serving_plan import OPTIONAL_KINDS


class Server:
    def __init__(self):
        self.requests = []
        self.routes = {}   # (method, path) -> (status, body)
        self.stalled = set()   # (method, path) that never answer (until the server stops)
        self.stop = threading.Event()


def start(server: Server):
    class Handler(JsonHandler):
        def _do(self, method):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            self.server_state.requests.append((method, self.path, headers, body))
            route = self.path.split("?")[0]
            if (method, route) in self.server_state.stalled:
                self.server_state.stop.wait(30)
                return
            not_found = (404, {"kind": "Status", "message": "nope"})
            status, payload = self.server_state.routes.get((method, route), not_found)
            self.reply_json(status, payload)

        def do_GET(self):
            self._do("GET")

        def do_PATCH(self):
            self._do("PATCH")

        def do_POST(self):
            self._do("POST")

        def do_DELETE(self):
            self._do("DELETE")

    Handler.server_state = server
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    t.start()
    return httpd, t


@pytest.fixture
def api_server():
    state = Server()
    httpd, t = start(state)
    yield state, f"http://127.0.0.1:{httpd.server_address[1]}"
    state.stop.set()
    httpd.shutdown()
    httpd.server_close()
    t.join()


def with_kube(url, fn, **kw):
    async def go():
        cfg = Configuration(host=url)
        cfg.api_key = {"BearerToken": "Bearer t0k"}
        async with ApiClient(cfg) as api:
            return await fn(ApiKube(api, **kw))
    return asyncio.run(go())


def test_paths():
    assert path("v1", "ConfigMap", "ns", "a") == "/api/v1/namespaces/ns/configmaps/a"
    assert path("v1", "Node", None) == "/api/v1/nodes"
    assert path("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "ns") == \
        "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ns/leaderworkersets"


def test_every_optional_kind_the_planner_applies_has_a_rest_path():
    # The planner applies these when their CRDs are served (GKE's Gateway policies among them):
    # the real client must know where they live, not only the test fakes.
    for kind, (api_version, plural) in OPTIONAL_KINDS.items():
        assert path(api_version, kind, "ns") == f"/apis/{api_version}/namespaces/ns/{plural}"


def test_server_side_apply_wire_format(api_server):
    state, url = api_server
    obj = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "ns"}}
    state.routes[("PATCH", "/apis/apps/v1/namespaces/ns/deployments/d")] = (200, {**obj, "status": {}})
    out = with_kube(url, lambda k: k.apply(obj))
    assert out["metadata"]["name"] == "d"
    method, p, headers, body = state.requests[0]
    assert method == "PATCH" and "fieldManager=tpusync-operator" in p and "force=true" in p
    assert headers["content-type"] == "application/apply-patch+yaml"
    assert headers["authorization"] == "Bearer t0k"
    assert json.loads(body) == obj


def test_delete_names_the_uid_it_checked(api_server):
    """A delete with a uid carries it as a precondition (the API server then deletes only that
    object); without one, only the propagation policy."""
    state, url = api_server
    route = ("DELETE", "/apis/apps/v1/namespaces/ns/statefulsets/s")
    state.routes[route] = (200, {"kind": "Status"})
    assert with_kube(url, lambda k: k.delete("apps/v1", "StatefulSet", "ns", "s", uid="u-1")) is True
    assert with_kube(url, lambda k: k.delete("apps/v1", "StatefulSet", "ns", "s")) is True
    assert [json.loads(r[3]) for r in state.requests] == [
        {"propagationPolicy": "Background", "preconditions": {"uid": "u-1"}}, {"propagationPolicy": "Background"}]
    state.routes[route] = (409, {"message": "Precondition failed: UID in precondition: u-1, UID in object meta: u-2"})
    with pytest.raises(KubeError) as e:
        with_kube(url, lambda k: k.delete("apps/v1", "StatefulSet", "ns", "s", uid="u-1"))
    assert e.value.status == 409


def test_get_404_is_none_and_errors_carry_status(api_server):
    state, url = api_server
    assert with_kube(url, lambda k: k.get("v1", "Secret", "ns", "x")) is None
    state.routes[("GET", "/api/v1/namespaces/ns/pods")] = (500, {"message": "etcd down"})
    with pytest.raises(KubeError) as e:
        with_kube(url, lambda k: k.list("v1", "Pod", "ns", {"b": "2", "a": "1"}))
    assert e.value.status == 500 and "etcd down" in str(e.value)
    assert e.value.request == "GET /api/v1/namespaces/ns/pods" and str(e.value).startswith(e.value.request)
    assert state.requests[-1][1].endswith("?labelSelector=a%3D1,b%3D2")


def test_create_conflict_and_status_patch(api_server):
    state, url = api_server
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "ns"}}
    state.routes[("POST", "/api/v1/namespaces/ns/secrets")] = (409, {"message": "exists"})
    assert with_kube(url, lambda k: k.create(secret)) is False
    state.routes[("PATCH", "/apis/tpusync.dev/v1alpha1/namespaces/ns/tpusyncpools/p/status")] = (200, {})
    with_kube(url, lambda k: k.patch_status("tpusync.dev/v1alpha1", "TPUSyncPool", "ns", "p", {"hosts": 1}))
    _, _p, headers, body = state.requests[-1]
    assert headers["content-type"] == "application/merge-patch+json" and json.loads(body) == {"status": {"hosts": 1}}


def test_served_kinds_discovery(api_server):
    state, url = api_server
    state.routes[("GET", "/apis/inference.networking.k8s.io/v1")] = (
        200, {"resources": [{"name": "inferencepools"}, {"name": "inferencepools/status"}]})
    kinds = {"InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
             "LeaderWorkerSet": ("leaderworkerset.x-k8s.io/v1", "leaderworkersets")}
    assert with_kube(url, lambda k: k.served_kinds(kinds)) == {"InferencePool"}


def test_a_request_that_gets_no_answer_fails_after_the_timeout(api_server):
    """An API server that accepts a request and never answers must not hold a pass for the
    client's default 5 minutes: the request fails as status 0, naming the request."""
    state, url = api_server
    state.stalled.add(("GET", "/api/v1/nodes"))
    with pytest.raises(KubeError) as e:
        with_kube(url, lambda k: k.list("v1", "Node", None, {}), timeout=0.3)
    assert e.value.status == 0 and e.value.request == "GET /api/v1/nodes"
    assert "no answer within 0.3 s" in str(e.value)
