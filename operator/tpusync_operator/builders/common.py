"""Metadata, labels and security settings shared by every builder."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MANAGED_BY = "tpusync-operator"
POOL_LABEL = "tpusync.dev/pool"
SERVING_LABEL = "tpusync.dev/serving"
COMPONENT_LABEL = "app.kubernetes.io/component"
ROLE_LABEL = "tpusync.dev/role"
LLMD_ROLE_LABEL = "llm-d.ai/role"
LLMD_SERVING_LABEL = "llm-d.ai/inference-serving"
DRAM_ANNOTATION = "tpusync.dev/dram-bytes"
DISK_ANNOTATION = "tpusync.dev/disk-bytes"


@dataclass(frozen=True)
class Owner:
    """The custom resource that owns the children (for ownerReferences and naming)."""
    api_version: str
    kind: str
    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(body["apiVersion"], body["kind"], meta["name"], meta["namespace"], meta["uid"])

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": self.api_version, "kind": self.kind, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def verbatim(value: str) -> str:
    """A string from a spec, escaped so that the kubelet passes it on as written when it is a
    word of a container's `command` or `args` or an `env` value. The kubelet expands `$(NAME)`
    there to the value of the container's variable NAME (HF_TOKEN, from a Secret, included)
    and reads `$$` as one `$` (k8s.io/kubernetes third_party/forked/golang/expansion), so every
    `$` is doubled. Every builder passes spec strings through this; only the operator's own
    references (`$(POD_IP)`) stay unescaped. Object names need none: they cannot hold a `$`."""
    return value.replace("$", "$$")


def base_labels(owner: Owner, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tpusync",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        COMPONENT_LABEL: component,
    }


def metadata(owner: Owner, name: str, labels: dict[str, str],
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": owner.namespace, "labels": dict(labels),
                            "ownerReferences": [owner.reference()]}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def resources(res: Any, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Container resources from models.Resources, plus `extra` in both requests and limits."""
    out: dict[str, Any] = {}
    requests = dict(res.requests or {})
    limits = dict(res.limits or {})
    for key, value in (extra or {}).items():
        requests[key] = value
        limits[key] = value
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def env_from_fields() -> list[dict[str, Any]]:
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def pod_templates(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, pod template) of every pod template in a rendered object: a Deployment's,
    StatefulSet's or DaemonSet's; a LeaderWorkerSet's leader (when it has its own) and workers;
    each role's of a DisaggregatedSet."""
    name, spec = obj["metadata"]["name"], obj.get("spec") or {}
    if "template" in spec:
        yield name, spec["template"]
    groups = [(name, spec)] if "leaderWorkerTemplate" in spec else []
    groups += [(f"{name}-{r['name']}", r["spec"]) for r in spec.get("roles", []) if obj["kind"] == "DisaggregatedSet"]
    for group_name, group in groups:
        lwt = group["leaderWorkerTemplate"]
        if "leaderTemplate" in lwt:
            yield group_name + "-leader", lwt["leaderTemplate"]
        yield group_name + "-worker", lwt["workerTemplate"]
