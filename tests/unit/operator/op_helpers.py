"""Helpers for the operator unit tests: fluent object builders, golden files,
an in-memory Kubernetes API (FakeKube) and a controllable clock."""

from __future__ import annotations

import copy
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

GOLDEN = Path(__file__).parent / "golden"
SAMPLES = Path(__file__).resolve().parents[3] / "samples"
UPDATE = os.environ.get("TPUSYNC_UPDATE_GOLDEN") == "1"


def assert_golden(name: str, objs: Any) -> None:
    """Compare objs with golden/<name>.yaml; TPUSYNC_UPDATE_GOLDEN=1 rewrites the file."""
    docs = objs if isinstance(objs, list) else [objs]
    text = "".join("---\n" + yaml.safe_dump(d, sort_keys=False, width=100) for d in docs)
    path = GOLDEN / f"{name}.yaml"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing: run the tests with TPUSYNC_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{name} differs from {path}; if intended, regenerate with TPUSYNC_UPDATE_GOLDEN=1"


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class PoolBody:
    """Fluent TPUSyncPool bodies: PoolBody().v7x("2x2x2").gke(workloadPolicy="p").build()."""

    def __init__(self, name: str = "pool", namespace: str = "ns"):
        self.body: dict[str, Any] = {
            "apiVersion": "tpusync.dev/v1alpha1", "kind": "TPUSyncPool",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 1},
            "spec": {"tpu": {"type": "v6e", "topology": "2x4"},
                     "provisioning": {"mode": "existing", "existing": {"nodePoolName": "tpu-np"}}},
        }

    def spec(self, **patch: Any) -> PoolBody:
        self.body["spec"] = merge(self.body["spec"], patch)
        return self

    def v7x(self, topology: str = "2x2x1") -> PoolBody:
        return self.spec(tpu={"type": "v7x", "topology": topology})

    def gke(self, **extra: Any) -> PoolBody:
        self.body["spec"]["provisioning"] = {"mode": "gke", "gke": {
            "project": "my-project", "location": "us-central1", "cluster": "c1", **extra}}
        return self

    def store(self, **store: Any) -> PoolBody:
        return self.spec(storeNodes={"enabled": True, **store})

    def ready(self) -> PoolBody:
        self.body["status"] = {"conditions": [{"type": "Ready", "status": "True", "reason": "PoolReady",
                                               "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
        return self

    def build(self) -> dict[str, Any]:
        return copy.deepcopy(self.body)


class ServingBody:
    def __init__(self, name: str = "llm", namespace: str = "ns", pool: str = "pool"):
        self.body: dict[str, Any] = {
            "apiVersion": "tpusync.dev/v1alpha1", "kind": "DisaggregatedServing",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 3},
            "spec": {"model": {"name": "m", "uri": "hf://org/m"}, "poolRef": {"name": pool},
                     "engine": {"type": "reference"}},
        }

    def spec(self, **patch: Any) -> ServingBody:
        self.body["spec"] = merge(self.body["spec"], patch)
        return self

    def build(self) -> dict[str, Any]:
        return copy.deepcopy(self.body)


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels", {}) or {}
    return all(labels.get(k) == v for k, v in selector.items())


Path_ = tuple[str, ...]


def field_paths(obj: dict[str, Any], prefix: Path_ = ()) -> set[Path_]:
    """The leaf fields of an object: a map's keys are walked into, a list or scalar is a leaf."""
    out: set[Path_] = set()
    for k, v in obj.items():
        if isinstance(v, dict) and v:
            out |= field_paths(v, (*prefix, k))
        else:
            out.add((*prefix, k))
    return out


def without_fields(obj: dict[str, Any], paths: set[Path_]) -> dict[str, Any]:
    """A copy of obj without the given leaf fields (maps they leave empty go too)."""
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if (k,) in paths:
            continue
        below = {p[1:] for p in paths if p[0] == k and len(p) > 1}
        kept = without_fields(v, below) if isinstance(v, dict) and below else copy.deepcopy(v)
        if isinstance(v, dict) and below and not kept:
            continue
        out[k] = kept
    return out


def merge_fields(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """new over base: maps merged key by key, everything else replaced."""
    out = copy.deepcopy(base)
    for k, v in new.items():
        out[k] = merge_fields(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else copy.deepcopy(v)
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """JSON merge patch (RFC 7386): maps merged, null deletes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class FakeKube:
    """In-memory API server for the reconcilers. `log` records every write and event in order.
    `faults[(operation, kind)]` is raised by every such call until removed (kind None for
    served_kinds); `fail_next` by the next apply. A uid in an applied object or in a delete's
    preconditions must be the stored object's, as on the API server (409 or 422 otherwise).

    Writes merge as the API server merges them. `apply` is server-side apply by one field
    manager with force: the applied fields are set, fields this manager applied before and
    no longer applies are removed, and fields others set (tests' `put`, direct edits) stay;
    the status subresource is left alone. Simplification: lists are atomic here, where the
    API server merges some (containers, env) by key. `patch_status` is a JSON merge patch."""

    def __init__(self, served: set[str] | None = None):
        self.objects: dict[tuple[str, str, str | None, str], dict[str, Any]] = {}
        self.applied: dict[tuple[str, str, str | None, str], set[Path_]] = {}   # fields our manager owns
        self.served = set(served) if served is not None else {
            "LeaderWorkerSet", "InferencePool", "InferenceObjective", "HTTPRoute", "HealthCheckPolicy",
            "GCPBackendPolicy"}
        self.log: list[tuple[str, ...]] = []
        self.fail_next: list[Exception] = []
        self.faults: dict[tuple[str, str | None], Exception] = {}

    def _fault(self, operation: str, kind: str | None) -> None:
        error = self.faults.get((operation, kind))
        if error is not None:
            raise error

    def key(self, obj: dict[str, Any]) -> tuple[str, str, str | None, str]:
        m = obj["metadata"]
        return (obj["apiVersion"], obj["kind"], m.get("namespace"), m["name"])

    def put(self, obj: dict[str, Any]) -> None:
        self.objects[self.key(obj)] = copy.deepcopy(obj)

    def find(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((o for (a, k, n, nm), o in self.objects.items() if k == kind and nm == name), None)

    def kinds(self) -> list[tuple[str, str]]:
        return sorted((k, nm) for (_, k, _, nm) in self.objects)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._fault("apply", obj["kind"])
        if self.fail_next:
            raise self.fail_next.pop(0)
        key = self.key(obj)
        prior = self.objects.get(key, {})
        self._precondition(obj["metadata"].get("uid"), self.objects.get(key), "PATCH", key)
        self.log.append(("apply", obj["kind"], obj["metadata"]["name"]))
        spec_fields = {k: v for k, v in obj.items() if k != "status"}
        applied = field_paths(spec_fields)
        stale = self.applied.get(key, set()) - applied
        stored = merge_fields(without_fields({k: v for k, v in prior.items() if k != "status"}, stale),
                              spec_fields)
        if "status" in prior:
            stored["status"] = prior["status"]
        self.objects[key] = stored
        self.applied[key] = applied
        return copy.deepcopy(stored)

    @staticmethod
    def _precondition(uid: str | None, stored: dict[str, Any] | None, method: str, key: tuple[Any, ...]) -> None:
        """A uid in a patch or in a delete's preconditions must be the stored object's. The API
        server answers 409 Conflict when no object exists or a delete's uid differs, and 422
        ("metadata.uid: field is immutable") when a patch's uid differs."""
        from tpusync_operator.kube import KubeError
        if uid is None or (stored or {}).get("metadata", {}).get("uid") == uid:
            return
        if method == "PATCH" and stored is not None:
            raise KubeError(422, f"metadata.uid: Invalid value: {uid!r}: field is immutable", f"{method} {key}")
        raise KubeError(409, f"Precondition failed: UID in precondition: {uid}", f"{method} {key}")

    async def create(self, obj: dict[str, Any]) -> bool:
        self._fault("create", obj["kind"])
        if self.key(obj) in self.objects:
            return False
        self.log.append(("create", obj["kind"], obj["metadata"]["name"]))
        self.put(obj)
        return True

    async def get(self, api_version, kind, namespace, name):
        self._fault("get", kind)
        self.log.append(("get", kind, name))
        obj = self.objects.get((api_version, kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    async def list(self, api_version, kind, namespace, selector):
        self._fault("list", kind)
        return [copy.deepcopy(o) for (a, k, n, _), o in self.objects.items()
                if a == api_version and k == kind and (namespace is None or n == namespace) and _matches(o, selector)]

    async def delete(self, api_version, kind, namespace, name, uid=None):
        self._fault("delete", kind)
        self._precondition(uid, self.objects.get((api_version, kind, namespace, name)), "DELETE",
                           (api_version, kind, namespace, name))
        self.applied.pop((api_version, kind, namespace, name), None)
        if self.objects.pop((api_version, kind, namespace, name), None) is None:
            return False
        self.log.append(("delete", kind, name))
        return True

    async def patch_status(self, api_version, kind, namespace, name, status):
        from tpusync_operator.kube import KubeError
        self._fault("patch_status", kind)
        obj = self.objects.get((api_version, kind, namespace, name))
        if obj is None:
            raise KubeError(404, f"{kind} {name} not found")
        self.log.append(("status", kind, name))
        obj["status"] = merge_patch(obj.get("status"), status)

    async def served_kinds(self, kinds):
        self._fault("served_kinds", None)
        return {k for k in kinds if k in self.served}


class Clock:
    def __init__(self) -> None:
        self.t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += timedelta(seconds=seconds)


def load_samples(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((SAMPLES / name).read_text()) if d]
