"""The GKE API contract server: a local HTTP server on 127.0.0.1 implementing the documented
GKE REST API (container.googleapis.com v1) that the operator uses, for contract tests. It is
written from the documentation, not from GKE's behaviour, and is not GKE:

- projects.locations.clusters.nodePools create / get / delete / setSize / setAutoscaling
  return long-running Operations; projects.locations.operations get polls them, and an
  operation is DONE after `polls_until_done` polls, when its effect is applied;
- a NodePool's JSON leaves out zero and false fields (proto3 JSON mapping) and carries no
  current node count: `initialNodeCount` stays what the pool was created with, the size a
  setSize sets is kept aside (`sizes`) as GKE keeps it in the pool's instance groups;
- GKE runs one operation at a time on a cluster: a mutating call while one runs is refused
  with 400 FAILED_PRECONDITION ("Cluster is running incompatible operation ...");
- a multi-host TPU slice node pool (placementPolicy with tpuTopology or policyName) is
  atomic: setSize is refused;
- request bodies are held against Google's published schema of the API (gke_schema.py, the
  container v1 discovery document): an unknown field, a wrong JSON type or a value outside
  an enum is refused with 400 INVALID_ARGUMENT, as GKE refuses it;
- bearer tokens are checked (401 UNAUTHENTICATED), errors are Google JSON errors
  {"error": {"code", "message", "status"}}, and `faults` are served first to inject
  429/5xx/403/... (optionally only to paths containing a given string);
- it also answers the GCE metadata server's token request (header `Metadata-Flavor:
  Google`) with the token "good", so one server can stand for both (the e2e suite).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any

from harness.gke_schema import problems, schemas
from harness.json_http import JsonHandler

PARENT = "/v1/projects/my-project/locations/us-central1/clusters/c1"
TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
OPS = "/v1/projects/my-project/locations/us-central1/operations/"


def proto_json(value: Any) -> Any:
    """Leave out zero, false and empty fields, as GKE's JSON does."""
    if isinstance(value, dict):
        out = {k: proto_json(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (0, False, None, "", [], {})}
    if isinstance(value, list):
        return [proto_json(v) for v in value]
    return value


class FakeGKEState:
    def __init__(self):
        self.lock = threading.Lock()
        self.pools: dict[str, dict] = {}
        self.sizes: dict[str, int] = {}                  # node pool -> node count (not in the NodePool)
        self.ops: dict[str, dict] = {}
        self.polls_until_done = 2
        self.done_after_s: float | None = None   # also complete operations this long after they start
        # (status, google status, headers[, path substring]) served first, to the first matching request
        self.faults: list[tuple] = []
        self.tokens = {"good"}
        self.requests: list[tuple[str, str, str]] = []
        self.bodies: list[dict] = []
        self.seq = 0

    def mutations(self) -> list[tuple[str, str]]:
        """(method, path) of every request that changes something."""
        return [(m, p) for m, p, _ in self.requests if m in ("POST", "DELETE")]

    def running(self) -> str | None:
        return next((name for name, op in self.ops.items() if op["status"] != "DONE"), None)

    def start(self, op_type: str, target: str, done: Callable[[], None] | None = None) -> dict:
        """A RUNNING operation; `done` applies its effect when it completes."""
        self.seq += 1
        name = f"operation-{self.seq}"
        self.ops[name] = {"name": name, "operationType": op_type, "status": "RUNNING", "targetLink": target,
                          "selfLink": OPS + name, "_polls": 0, "_done": done, "_started": time.monotonic()}
        return public(self.ops[name])

    def finish(self, op: dict) -> None:
        op["status"] = "DONE"
        if op["_done"]:
            op["_done"]()

    def finish_due(self) -> None:
        """Completes the operations older than done_after_s, as GKE does without being polled."""
        if self.done_after_s is None:
            return
        for op in self.ops.values():
            if op["status"] != "DONE" and time.monotonic() - op["_started"] >= self.done_after_s:
                self.finish(op)


def public(op: dict) -> dict:
    return {k: v for k, v in op.items() if not k.startswith("_")}


def _multi_host(pool: dict) -> bool:
    pp = pool.get("placementPolicy") or {}
    return bool(pp.get("tpuTopology") or pp.get("policyName"))


def make_handler(state: FakeGKEState):
    class Handler(JsonHandler):
        def _error(self, code: int, status: str, message: str, headers: dict | None = None):
            self.reply_json(code, {"error": {"code": code, "message": message, "status": status}}, headers)

        def _body(self) -> dict:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            state.bodies.append(body)
            return body

        def _invalid(self, schema: str, body: dict) -> bool:
            """Answers 400 INVALID_ARGUMENT if the body breaks the API's schema."""
            found = problems(schema, body)
            if found:
                self._error(400, "INVALID_ARGUMENT", "Invalid JSON payload received. " + "; ".join(found))
            return bool(found)

        def _fault(self) -> tuple | None:
            for i, fault in enumerate(state.faults):
                if len(fault) < 4 or fault[3] in self.path:
                    return state.faults.pop(i)
            return None

        def _handle(self, method: str):
            with state.lock:
                state.finish_due()
                auth = self.headers.get("Authorization", "")
                state.requests.append((method, self.path, auth))
                if self.path == TOKEN_PATH and method == "GET":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._error(403, "PERMISSION_DENIED", "Missing Metadata-Flavor: Google")
                    return self.reply_json(200, {"access_token": "good", "expires_in": 3600, "token_type": "Bearer"})
                fault = self._fault()
                if fault:
                    code, status, headers = fault[:3]
                    return self._error(code, status, f"injected {code}", headers)
                if not auth.startswith("Bearer ") or auth[7:] not in state.tokens:
                    return self._error(401, "UNAUTHENTICATED", "Request had invalid authentication credentials.")
                path = self.path
                if path.startswith(OPS) and method == "GET":
                    return self._get_operation(path[len(OPS):])
                if not path.startswith(PARENT + "/nodePools"):
                    return self._error(404, "NOT_FOUND", f"no route for {method} {path}")
                busy = state.running()
                if method in ("POST", "DELETE") and busy:
                    return self._error(400, "FAILED_PRECONDITION",
                                       f"Cluster is running incompatible operation {busy}.")
                if path == PARENT + "/nodePools" and method == "POST":
                    body = self._body()
                    return None if self._invalid("CreateNodePoolRequest", body) else self._create(body)
                name, _, verb = path[len(PARENT + "/nodePools/"):].partition(":")
                if name not in state.pools:
                    return self._error(404, "NOT_FOUND", f"Not found: {name}")
                target = f"{PARENT}/nodePools/{name}"
                if method == "GET" and not verb:
                    return self.reply_json(200, proto_json(state.pools[name]))
                if method == "DELETE" and not verb:
                    state.pools[name]["status"] = "STOPPING"
                    return self.reply_json(200, state.start(
                        "DELETE_NODE_POOL", target, lambda: (state.pools.pop(name, None), state.sizes.pop(name, None))))
                if method == "POST" and verb == "setSize":
                    body = self._body()
                    return None if self._invalid("SetNodePoolSizeRequest", body) else \
                        self._set_size(name, target, body)
                if method == "POST" and verb == "setAutoscaling":
                    body = self._body()
                    return None if self._invalid("SetNodePoolAutoscalingRequest", body) else \
                        self._set_autoscaling(name, target, body)
                return self._error(404, "NOT_FOUND", f"no route for {method} {path}")

        def _get_operation(self, name: str):
            op = state.ops.get(name)
            if op is None:
                return self._error(404, "NOT_FOUND", "operation not found")
            op["_polls"] += 1
            if op["_polls"] >= state.polls_until_done and op["status"] != "DONE":
                state.finish(op)
            return self.reply_json(200, public(op))

        def _create(self, body: dict):
            np = body.get("nodePool") or {}
            if not np.get("name") or "machineType" not in np.get("config", {}):
                return self._error(400, "INVALID_ARGUMENT", "nodePool.name and config.machineType required")
            if np["name"] in state.pools:
                return self._error(409, "ALREADY_EXISTS", f"Already exists: {np['name']}")
            name = np["name"]
            state.pools[name] = {**copy.deepcopy(np), "status": "PROVISIONING"}
            state.sizes[name] = int(np.get("initialNodeCount", 0))

            def done():
                state.pools[name]["status"] = "RUNNING"
            return self.reply_json(200, state.start("CREATE_NODE_POOL", f"{PARENT}/nodePools/{name}", done))

        def _set_size(self, name: str, target: str, body: dict):
            count = body.get("nodeCount")
            if not isinstance(count, int) or count < 0:
                return self._error(400, "INVALID_ARGUMENT", "nodeCount must be a non-negative integer")
            if _multi_host(state.pools[name]):   # documented as atomic; the error code is not
                return self._error(400, "INVALID_ARGUMENT",
                                   f"Node pool {name} is a multi-host TPU slice and cannot be resized.")

            def done():
                state.sizes[name] = count
            return self.reply_json(200, state.start("SET_NODE_POOL_SIZE", target, done))

        def _set_autoscaling(self, name: str, target: str, body: dict):
            a = body.get("autoscaling")
            if not isinstance(a, dict):
                return self._error(400, "INVALID_ARGUMENT", "autoscaling is required")
            per_zone = "minNodeCount" in a or "maxNodeCount" in a
            total = "totalMinNodeCount" in a or "totalMaxNodeCount" in a
            lo, hi = (a.get("totalMinNodeCount", 0), a.get("totalMaxNodeCount", 0)) if total else \
                (a.get("minNodeCount", 0), a.get("maxNodeCount", 0))
            if a.get("enabled") and ((per_zone and total) or lo < 0 or hi < max(lo, 1)):
                return self._error(400, "INVALID_ARGUMENT", "invalid autoscaling limits")
            applied = {**a, "locationPolicy": a.get("locationPolicy", "BALANCED")} if a.get("enabled") else {}

            def done():
                state.pools[name]["autoscaling"] = applied
            return self.reply_json(200, state.start("UPDATE_CLUSTER", target, done))

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

        def do_DELETE(self):
            self._handle("DELETE")

    return Handler


def serve() -> tuple[FakeGKEState, str, Callable[[], None]]:
    """Start a server; returns (state, base URL, stop)."""
    schemas()   # the discovery document, downloaded now if not cached, not in a request
    state = FakeGKEState()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
    return state, f"http://127.0.0.1:{httpd.server_address[1]}", stop
