"""Generate the CRDs in crds/ from the pydantic models (the single source of truth).

    python -m tpusync_operator.crdgen --out crds/      # write
    python -m tpusync_operator.crdgen --check crds/    # exit 1 when crds/ differs

The pydantic JSON schema is rewritten into a Kubernetes *structural* schema: $refs are
inlined, Optional's `anyOf [X, null]` collapses to X, titles and examples go, nested
objects keep their `default: {}` so the API server defaults nested fields, and model-level
CEL rules (`x-kubernetes-validations`) stay with their object. Anything left that a
structural schema forbids (anyOf, oneOf, allOf, $ref, a property without a type) is an
error here rather than at `kubectl apply` time.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from . import GROUP, VERSION
from .builders import names
from .models import (
    GKE_NODE_POOL_MAX,
    DisaggregatedServingSpec,
    DisaggregatedServingStatus,
    TPUSyncPoolSpec,
    TPUSyncPoolStatus,
)

_DROP = {"title", "examples"}
_FORBIDDEN = {"anyOf", "oneOf", "allOf", "$ref", "not", "$defs"}


class SchemaError(ValueError):
    pass


def _inline(node: Any, defs: dict[str, Any], path: str) -> Any:
    if isinstance(node, list):
        return [_inline(n, defs, path) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").split("/")[-1]])
        target.update(node)  # siblings (description, default) win
        node = target
    if "allOf" in node and len(node["allOf"]) == 1:
        inner = node.pop("allOf")[0]
        node = {**_inline(inner, defs, path), **node}
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) != 1:
            raise SchemaError(f"{path}: a union of {len(options)} types is not structural")
        del node["anyOf"]
        node = {**_inline(options[0], defs, path), **node}
        if node.get("default", 0) is None:
            del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {k: _inline(v, defs, f"{path}.{k}") for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _inline(value, defs, f"{path}[]")
        else:
            out[key] = value
    if out.get("default", 0) is None:
        del out["default"]
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    return out


def _check_structural(node: Any, path: str) -> None:
    if not isinstance(node, dict):
        return
    bad = _FORBIDDEN & node.keys()
    if bad:
        raise SchemaError(f"{path}: {sorted(bad)} is not allowed in a structural schema")
    if "type" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        raise SchemaError(f"{path}: every schema node needs a type")
    for key, child in node.get("properties", {}).items():
        _check_structural(child, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _check_structural(node[key], f"{path}[]")


def structural_schema(model: type[BaseModel], path: str) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema: dict[str, Any] = _inline(raw, defs, path)
    _check_structural(schema, path)
    return schema


_READY = '.status.conditions[?(@.type=="Ready")].status'

KINDS: dict[str, dict[str, Any]] = {
    "TPUSyncPool": {
        "plural": "tpusyncpools", "singular": "tpusyncpool", "shortNames": ["tsp", "tpupool"],
        "spec": TPUSyncPoolSpec, "status": TPUSyncPoolStatus,
        "description": "A pool of TPU hosts running the tpusync transfer sidecar.",
        "columns": [
            ("TPU", "string", ".spec.tpu.type"), ("Topology", "string", ".spec.tpu.topology"),
            ("Mode", "string", ".spec.provisioning.mode"), ("Ready", "string", _READY),
            ("Hosts", "integer", ".status.readyHosts"), ("Sidecars", "integer", ".status.readySidecars"),
            ("NodePool", "string", ".status.nodePool.state"),
        ],
    },
    "DisaggregatedServing": {
        "plural": "disaggregatedservings", "singular": "disaggregatedserving",
        "shortNames": ["dserving", "dsv"],
        "spec": DisaggregatedServingSpec, "status": DisaggregatedServingStatus,
        "description": "An LLM served with separate prefill and decode roles on a TPUSyncPool, routed by llm-d.",
        # Units of the serving (each role scaled by its replicas per unit): kubectl scale, HPA.
        "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                  "labelSelectorPath": ".status.selector"},
        "columns": [
            ("Model", "string", ".spec.model.name"), ("Engine", "string", ".spec.engine.type"),
            ("Pool", "string", ".spec.poolRef.name"), ("Ready", "string", _READY),
            ("Units", "integer", ".status.replicas"),
            ("Prefill", "integer", ".status.prefill.readyReplicas"),
            ("Decode", "integer", ".status.decode.readyReplicas"),
            ("Endpoint", "string", ".status.endpoint"),
        ],
    },
}


_LABEL = ("a DNS-1035 label (a lowercase letter first, then lowercase letters, digits and '-', as its Services' "
          "names must be)")


def _name_rule(kind: str) -> dict[str, str]:
    """The root's CEL rule on metadata.name: a name every child the object renders can derive its
    own from (builders.names computes the limits from the children's suffixes)."""
    name = "self.metadata.name"
    if kind == "TPUSyncPool":
        store = ("has(self.spec.storeNodes) && has(self.spec.storeNodes.enabled) && self.spec.storeNodes.enabled && "
                 "(!has(self.spec.storeNodes.kind) || self.spec.storeNodes.kind == 'StatefulSet')")
        short, long = names.pool_name_max(store_statefulset=True), names.pool_name_max(store_statefulset=False)
        return {"rule": f"{name}.matches('{names.NAME_PATTERN}') && size({name}) <= ({store} ? {short} : {long})",
                "message": f"metadata.name must be {_LABEL} of at most {long} characters, {short} with "
                           f"spec.storeNodes of kind StatefulSet: the pool's Service <name>-peers must have a name "
                           f"of at most {names.LABEL_MAX} characters, its StatefulSet <name>-store one of at most "
                           f"{names.STATEFULSET_MAX} (its pods' controller-revision-hash label)"}
    cases = sorted([
        (names.serving_name_max(lockstep=True), "has(self.spec.rollout) && has(self.spec.rollout.strategy) && "
                                                "self.spec.rollout.strategy == 'Lockstep'",
         "with spec.rollout.strategy Lockstep"),
        (names.serving_name_max(multi_host=True), " || ".join(
            f"(has(self.spec.{r}) && has(self.spec.{r}.hostsPerReplica) && self.spec.{r}.hostsPerReplica > 1)"
            for r in names.ROLES), "with multi-host roles"),
        (names.serving_name_max(sglang=True),
         "has(self.spec.engine) && has(self.spec.engine.type) && self.spec.engine.type == 'sglang-jax'",
         "with spec.engine.type sglang-jax"),
    ], reverse=True)
    limit = str(names.serving_name_max())
    for n, condition, _ in cases:
        limit = f"({condition}) ? {n} : {limit}"
    exceptions = ", ".join(f"{n} {why}" for n, _, why in reversed(cases))
    return {"rule": f"{name}.matches('{names.NAME_PATTERN}') && size({name}) <= ({limit})",
            "message": f"metadata.name must be {_LABEL} of at most {names.serving_name_max()} characters "
                       f"({exceptions}): the serving's Services <name>-prefill, <name>-epp and "
                       f"<name>-pd-bootstrap must have names of at most {names.LABEL_MAX} characters, the "
                       f"StatefulSets of its LeaderWorkerSets "
                       f"(<name>-<role>-<group>; with Lockstep <name>-<revision>-<role>-<group>) names of at most "
                       f"{names.STATEFULSET_MAX} (their pods' controller-revision-hash label)"}


def _gke_node_pool_rule(kind: str) -> list[dict[str, str]]:
    """In mode gke, the node pool's default name is the pool's: within GKE's limit (the planner
    checks the names of further slices, <name>-<i>, which the schema cannot count)."""
    if kind != "TPUSyncPool":
        return []
    gke = "self.spec.provisioning"
    return [{"rule": f"!has({gke}.mode) || {gke}.mode != 'gke' || !has({gke}.gke) || has({gke}.gke.nodePoolName) || "
                     f"size(self.metadata.name) <= {GKE_NODE_POOL_MAX}",
             "message": f"metadata.name names the GKE node pool in mode gke (spec.provisioning.gke.nodePoolName "
                        f"unset), and GKE allows {GKE_NODE_POOL_MAX} characters: shorten it, or set "
                        f"spec.provisioning.gke.nodePoolName"}]


def build_crd(kind: str) -> dict[str, Any]:
    k = KINDS[kind]
    spec = structural_schema(k["spec"], "spec")
    status = structural_schema(k["status"], "status")
    spec.pop("default", None)
    columns = [{"name": n, "type": t, "jsonPath": p} for n, t, p in k["columns"]]
    columns.append({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{k['plural']}.{GROUP}",
            "annotations": {"tpusync.dev/generated-by": "python -m tpusync_operator.crdgen"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind, "listKind": f"{kind}List", "plural": k["plural"],
                "singular": k["singular"], "shortNames": k["shortNames"], "categories": ["tpusync"],
            },
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}, **({"scale": k["scale"]} if "scale" in k else {})},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": k["description"],
                    "required": ["spec"],
                    "x-kubernetes-validations": [_name_rule(kind), *_gke_node_pool_rule(kind)],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec,
                        "status": status,
                    },
                }},
            }],
        },
    }


def _peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    """kopf's documented peering resources (group kopf.dev), needed for --peering."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev"},
        "spec": {
            "group": "kopf.dev", "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": plural[:-1]},
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {"status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }}}],
        },
    }


def render_all() -> dict[str, str]:
    """File name -> YAML text, deterministic."""
    def dump(*docs: dict[str, Any]) -> str:
        return "".join("---\n" + yaml.safe_dump(d, sort_keys=False, width=100) for d in docs)

    files = {f"{GROUP}_{KINDS[k]['plural']}.yaml": dump(build_crd(k)) for k in KINDS}
    files["kopf.dev_peerings.yaml"] = dump(
        _peering_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
        _peering_crd("KopfPeering", "kopfpeerings", "Namespaced"))
    return files


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (out / name).write_text(text)


def check(directory: Path) -> list[str]:
    """Unified diffs between directory and a fresh generation (empty when identical)."""
    diffs = []
    for name, text in render_all().items():
        path = directory / name
        current = path.read_text() if path.exists() else ""
        if current != text:
            diffs.append("".join(difflib.unified_diff(
                current.splitlines(True), text.splitlines(True), f"{path} (committed)", f"{path} (generated)")))
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpusync_operator.crdgen", description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="write the CRDs into this directory")
    group.add_argument("--check", type=Path, help="fail when this directory differs from the models")
    args = parser.parse_args(argv)
    if args.out:
        write(args.out)
        return 0
    diffs = check(args.check)
    for d in diffs:
        sys.stderr.write(d)
    if diffs:
        sys.stderr.write(f"\n{args.check} is stale: run `make crds` and commit the result\n")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
