"""A small GKE API client (container.googleapis.com v1) for TPU node pools, over httpx.

Endpoints used (documented REST contract):
  POST   /v1/projects/{p}/locations/{l}/clusters/{c}/nodePools          -> Operation
  GET    /v1/projects/{p}/locations/{l}/clusters/{c}/nodePools/{name}   -> NodePool
  DELETE /v1/projects/{p}/locations/{l}/clusters/{c}/nodePools/{name}   -> Operation
  POST   .../nodePools/{name}:setSize        {"nodeCount": N}                  -> Operation
  POST   .../nodePools/{name}:setAutoscaling {"autoscaling": NodePoolAutoscaling} -> Operation
  GET    /v1/projects/{p}/locations/{l}/operations/{op}                 -> Operation
Errors are Google JSON errors: {"error": {"code", "message", "status"}}. GKE runs one
operation at a time on a cluster and refuses another meanwhile with 400 FAILED_PRECONDITION
("Cluster is running incompatible operation ..."); that, like 409, is a GKEConflict.

Credentials: a bearer token from the GCE metadata server (Workload Identity on GKE), cached
until shortly before it expires; a 401 refreshes the token once. The token goes only to the
endpoint of the operator's configuration (`configured_endpoint`), never to one an object
names.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

DEFAULT_ENDPOINT = "https://container.googleapis.com"
METADATA_URL = "http://metadata.google.internal"
TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
ENDPOINT_ENV = "TPUSYNC_GKE_ENDPOINT"       # the chart's gke.endpoint
METADATA_URL_ENV = "TPUSYNC_METADATA_URL"   # the chart's gke.metadataURL


def configured_endpoint(env: Mapping[str, str]) -> str:
    """The GKE API base URL from the operator's configuration (empty or unset: GKE's own)."""
    return env.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT


def configured_metadata_url(env: Mapping[str, str]) -> str:
    """The token source from the operator's configuration (empty or unset: the GCE metadata server)."""
    return env.get(METADATA_URL_ENV) or METADATA_URL


class GKEError(Exception):
    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"GKE API {status} {reason}: {message}".replace(" :", ":"))
        self.status = status
        self.message = message
        self.reason = reason
        self.retry_after: float | None = None  # seconds, from the answer's Retry-After header


class GKEAuthError(GKEError):
    """401/403: the operator's identity may not call the API (fix IAM / Workload Identity)."""


class GKETransientError(GKEError):
    """429, 5xx or a network failure: retry later."""


class GKEConflict(GKEError):
    """409, or 400 FAILED_PRECONDITION: the node pool exists already, or another operation is
    running on the cluster. Retry later."""


class TokenProvider(Protocol):
    async def token(self, *, refresh: bool = False) -> str: ...


class StaticToken:
    def __init__(self, value: str):
        self.value = value

    async def token(self, *, refresh: bool = False) -> str:
        return self.value


class MetadataServerToken:
    """Access tokens from the metadata server (GKE Workload Identity)."""

    def __init__(self, base_url: str = METADATA_URL, *, transport: httpx.AsyncBaseTransport | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._client = httpx.AsyncClient(base_url=base_url, transport=transport, timeout=10.0)
        self._clock = clock
        self._value: str | None = None
        self._expires = 0.0
        self._lock = asyncio.Lock()

    async def token(self, *, refresh: bool = False) -> str:
        async with self._lock:
            if refresh or self._value is None or self._clock() >= self._expires:
                try:
                    r = await self._client.get(TOKEN_PATH, headers={"Metadata-Flavor": "Google"})
                except httpx.HTTPError as e:
                    raise GKETransientError(0, f"metadata server unreachable: {e}") from e
                if r.status_code != 200:
                    raise GKEAuthError(r.status_code, f"metadata server refused a token: {r.text[:200]}")
                data = r.json()
                self._value = data["access_token"]
                self._expires = self._clock() + max(0, int(data.get("expires_in", 0)) - 60)
            return self._value

    async def aclose(self) -> None:
        await self._client.aclose()


@dataclass(frozen=True)
class ClusterRef:
    project: str
    location: str
    cluster: str

    @property
    def parent(self) -> str:
        return f"/v1/projects/{self.project}/locations/{self.location}/clusters/{self.cluster}"

    def operation(self, name: str) -> str:
        return f"/v1/projects/{self.project}/locations/{self.location}/operations/{name.rsplit('/', 1)[-1]}"


class GKEClient:
    def __init__(self, tokens: TokenProvider, base_url: str = DEFAULT_ENDPOINT, *,
                 transport: httpx.AsyncBaseTransport | None = None, timeout: float = 30.0,
                 retries: int = 3, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self._client = httpx.AsyncClient(base_url=base_url, transport=transport, timeout=timeout)
        self._tokens = tokens
        self._retries = retries
        self._sleep = sleep

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        refreshed = False
        attempt = 0
        while True:
            token = await self._tokens.token(refresh=refreshed)
            try:
                r = await self._client.request(method, path, json=body,
                                               headers={"Authorization": f"Bearer {token}"})
            except httpx.HTTPError as e:
                err: GKEError = GKETransientError(0, f"{type(e).__name__}: {e}")
            else:
                if r.status_code < 300:
                    return r.json() if r.content else {}
                err = _error(r)
                if isinstance(err, GKEAuthError) and r.status_code == 401 and not refreshed:
                    refreshed = True
                    continue
            if isinstance(err, GKETransientError) and attempt < self._retries:
                attempt += 1
                await self._sleep(_retry_after(err, attempt))
                continue
            raise err

    async def create_node_pool(self, cluster: ClusterRef, request: dict[str, Any]) -> dict[str, Any]:
        """Start creating a node pool; returns the Operation. GKEConflict if it exists."""
        return await self._call("POST", f"{cluster.parent}/nodePools", request)

    async def _call_unless_gone(self, method: str, path: str) -> dict[str, Any] | None:
        """_call's answer, or None when GKE answers 404 (no such object)."""
        try:
            return await self._call(method, path)
        except GKEError as e:
            if e.status == 404:
                return None
            raise

    async def get_node_pool(self, cluster: ClusterRef, name: str) -> dict[str, Any] | None:
        return await self._call_unless_gone("GET", f"{cluster.parent}/nodePools/{name}")

    async def delete_node_pool(self, cluster: ClusterRef, name: str) -> dict[str, Any] | None:
        """Start deleting; returns the Operation, or None when the node pool is already gone."""
        return await self._call_unless_gone("DELETE", f"{cluster.parent}/nodePools/{name}")

    async def set_node_pool_size(self, cluster: ClusterRef, name: str, node_count: int) -> dict[str, Any]:
        """Start resizing a node pool to node_count nodes; returns the Operation. GKEConflict
        while another operation runs on the cluster."""
        return await self._call("POST", f"{cluster.parent}/nodePools/{name}:setSize", {"nodeCount": node_count})

    async def set_node_pool_autoscaling(self, cluster: ClusterRef, name: str,
                                        autoscaling: dict[str, Any]) -> dict[str, Any]:
        """Start changing a node pool's autoscaling (a NodePoolAutoscaling; {"enabled": false}
        turns it off); returns the Operation. GKEConflict while another operation runs."""
        return await self._call("POST", f"{cluster.parent}/nodePools/{name}:setAutoscaling",
                                {"autoscaling": autoscaling})

    async def get_operation(self, cluster: ClusterRef, name: str) -> dict[str, Any]:
        return await self._call("GET", cluster.operation(name))

    async def wait_operation(self, cluster: ClusterRef, name: str, *, interval: float = 5.0,
                             timeout: float = 1800.0) -> dict[str, Any]:  # noqa: ASYNC109 - counts injected sleeps
        """Poll a long-running operation until DONE (used outside the reconcile loop, e.g. CLI)."""
        waited = 0.0
        while True:
            op = await self.get_operation(cluster, name)
            if op.get("status") == "DONE":
                return op
            if waited >= timeout:
                raise GKETransientError(0, f"operation {name} not DONE after {timeout:.0f}s")
            await self._sleep(interval)
            waited += interval


def _error(r: httpx.Response) -> GKEError:
    try:
        e = r.json().get("error", {})
        message, reason = e.get("message", r.text[:200]), e.get("status", "")
    except ValueError:
        message, reason = r.text[:200], ""
    cls: type[GKEError] = GKEError
    if r.status_code in (401, 403):
        cls = GKEAuthError
    elif r.status_code == 409 or (r.status_code == 400 and reason == "FAILED_PRECONDITION"):
        cls = GKEConflict
    elif r.status_code == 429 or r.status_code >= 500:
        cls = GKETransientError
    err = cls(r.status_code, message, reason)
    retry_after = r.headers.get("Retry-After")
    err.retry_after = float(retry_after) if retry_after and retry_after.isdigit() else None
    return err


def _retry_after(err: GKEError, attempt: int) -> float:
    hinted = err.retry_after
    return float(hinted) if hinted is not None else min(30.0, 0.5 * 2 ** attempt)
