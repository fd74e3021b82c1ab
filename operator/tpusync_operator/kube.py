"""Thin Kubernetes I/O over kubernetes-asyncio's ApiClient: server-side apply with a field
manager, get/list/delete, status patches, and discovery of optional CRDs. No decisions."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from . import FIELD_MANAGER

# (apiVersion, kind) -> (plural, namespaced)
RESOURCES: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "Service"): ("services", True),
    ("v1", "ServiceAccount"): ("serviceaccounts", True),
    ("v1", "Pod"): ("pods", True),
    ("v1", "Event"): ("events", True),
    ("v1", "PersistentVolumeClaim"): ("persistentvolumeclaims", True),
    ("v1", "Node"): ("nodes", False),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("apps/v1", "StatefulSet"): ("statefulsets", True),
    ("apps/v1", "DaemonSet"): ("daemonsets", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("networkpolicies", True),
    ("policy/v1", "PodDisruptionBudget"): ("poddisruptionbudgets", True),
    ("rbac.authorization.k8s.io/v1", "Role"): ("roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): ("leaderworkersets", True),
    ("disaggregatedset.x-k8s.io/v1", "DisaggregatedSet"): ("disaggregatedsets", True),
    ("inference.networking.k8s.io/v1", "InferencePool"): ("inferencepools", True),
    ("llm-d.ai/v1alpha2", "InferenceObjective"): ("inferenceobjectives", True),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): ("httproutes", True),
    ("networking.gke.io/v1", "HealthCheckPolicy"): ("healthcheckpolicies", True),
    ("networking.gke.io/v1", "GCPBackendPolicy"): ("gcpbackendpolicies", True),
    ("tpusync.dev/v1alpha1", "TPUSyncPool"): ("tpusyncpools", True),
    ("tpusync.dev/v1alpha1", "DisaggregatedServing"): ("disaggregatedservings", True),
}


class KubeError(Exception):
    """A request the API server failed or refused; status 0: no answer (reset, timeout).
    `request` ("GET /api/v1/...") says which, for the status that reports it."""

    def __init__(self, status: int, message: str, request: str = ""):
        super().__init__(f"{request + ': ' if request else ''}Kubernetes API {status}: {message}")
        self.status = status
        self.request = request


class Kube(Protocol):
    """What the reconcilers need from the API server (the fake in tests implements this)."""
    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]: ...
    async def create(self, obj: dict[str, Any]) -> bool: ...
    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None: ...
    async def list(self, api_version: str, kind: str, namespace: str | None,
                   selector: dict[str, str]) -> list[dict[str, Any]]: ...
    async def delete(self, api_version: str, kind: str, namespace: str, name: str,
                     uid: str | None = None) -> bool: ...
    async def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                           status: dict[str, Any]) -> None: ...
    async def served_kinds(self, kinds: dict[str, tuple[str, str]]) -> set[str]: ...


def path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    plural, namespaced = RESOURCES[(api_version, kind)]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced and namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    return f"{base}/{name}" if name else base


def selector_string(selector: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


class ApiKube:
    """Kube over a kubernetes_asyncio ApiClient (authenticated as the operator). Every request
    gives up after `timeout` seconds (the client's default is 5 minutes, during which a pass
    of an object would hang on an API server that accepted the connection and never answers)."""

    def __init__(self, api: ApiClient, field_manager: str = FIELD_MANAGER, timeout: float = 30.0):
        self.api = api
        self.field_manager = field_manager
        self.timeout = timeout

    async def _call(self, method: str, url: str, *, body: Any = None, query: list[tuple[str, str]] | None = None,
                    content_type: str = "application/json") -> Any:
        request = f"{method} {url}"
        try:
            # Unparsed response: kubernetes-asyncio then raises for nothing, so check the status here.
            response = await self.api.call_api(
                url, method, query_params=query or [], body=body,
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True,
                _request_timeout=self.timeout)
            data = await response.read()
        except ApiException as e:   # raised by older clients even without preloading
            raise KubeError(e.status or 0, str(e.reason), request) from e
        except TimeoutError as e:
            raise KubeError(0, f"no answer within {self.timeout:g} s", request) from e
        except (aiohttp.ClientError, OSError) as e:
            raise KubeError(0, f"{type(e).__name__}: {e}", request) from e
        if not 200 <= response.status <= 299:
            message = data.decode("utf-8", "replace")
            with contextlib.suppress(ValueError, AttributeError):  # not JSON, or not an object
                message = json.loads(message).get("message", message)
            raise KubeError(response.status, message, request)
        return json.loads(data) if data else None

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply, forced. A metadata.uid in obj is a precondition: the API server
        refuses the patch when the object is absent (409) or another (422: uid is immutable)."""
        meta = obj["metadata"]
        url = path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        applied: dict[str, Any] = await self._call("PATCH", url, body=obj, content_type="application/apply-patch+yaml",
                                                   query=[("fieldManager", self.field_manager), ("force", "true")])
        return applied

    async def create(self, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        try:
            await self._call("POST", path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj,
                             query=[("fieldManager", self.field_manager)])
        except KubeError as e:
            if e.status == 409:
                return False
            raise
        return True

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] | None = await self._call("GET", path(api_version, kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        return found

    async def list(self, api_version: str, kind: str, namespace: str | None,
                   selector: dict[str, str]) -> list[dict[str, Any]]:
        query = [("labelSelector", selector_string(selector))] if selector else []
        result = await self._call("GET", path(api_version, kind, namespace), query=query)
        return list(result.get("items", []))

    async def delete(self, api_version: str, kind: str, namespace: str, name: str,
                     uid: str | None = None) -> bool:
        """False when absent. `uid`: delete only that object (a precondition; 409 if replaced)."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self._call("DELETE", path(api_version, kind, namespace, name), body=body)
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                           status: dict[str, Any]) -> None:
        await self._call("PATCH", path(api_version, kind, namespace, name) + "/status",
                         body={"status": status}, content_type="application/merge-patch+json")

    async def annotate(self, api_version: str, kind: str, namespace: str, name: str,
                       annotations: dict[str, str]) -> None:
        await self._call("PATCH", path(api_version, kind, namespace, name),
                         body={"metadata": {"annotations": annotations}},
                         content_type="application/merge-patch+json")

    async def served_kinds(self, kinds: dict[str, tuple[str, str]]) -> set[str]:
        """Which of kinds {kind: (apiVersion, plural)} the API server serves right now."""
        served: set[str] = set()
        by_version: dict[str, list[tuple[str, str]]] = {}
        for kind, (api_version, plural) in kinds.items():
            by_version.setdefault(api_version, []).append((kind, plural))
        for api_version, entries in by_version.items():
            try:
                doc = await self._call("GET", f"/apis/{api_version}")
            except KubeError as e:
                if e.status == 404:
                    continue
                raise
            plurals = {r.get("name") for r in doc.get("resources", [])}
            served |= {kind for kind, plural in entries if plural in plurals}
        return served
