"""`python -m tpusync_operator render FILE...`: every object the operator would create, and
every GKE node pool it would request, for the TPUSyncPool and DisaggregatedServing objects in
the files, printed as YAML documents without a cluster (like `helm template`).

It runs the operator's own planner on the objects as the API server would store them (the
models apply the CRD defaults), assuming every optional CRD (LeaderWorkerSet, InferencePool,
...) is installed. What only a cluster decides is marked in comments: the owner's uid, the
random contents of the Secrets the operator generates once.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml
from pydantic import BaseModel

from .builders import sglang_pd
from .builders.common import Owner
from .builders.pool import build_auth_secret
from .builders.serving import PoolInfo
from .gke import ClusterRef, configured_endpoint
from .models import DisaggregatedServingSpec, TPUSyncPoolSpec
from .planner import OPTIONAL_KINDS, PlanError, plan_pool, plan_serving

GROUP_VERSION = "tpusync.dev/v1alpha1"
UID = "<uid>"   # assigned by the API server
GENERATED = "<generated once by the operator: 32 random bytes>"


class RenderError(ValueError):
    """An input the operator would refuse, with the object and field named."""


@dataclass
class Rendered:
    """One output document: the object (or request body) and the comment lines above it."""
    comment: list[str]
    body: dict[str, Any]


def load(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Every TPUSyncPool and DisaggregatedServing in the files ("-" reads stdin), in order."""
    docs: list[dict[str, Any]] = []
    for path in paths:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            if doc.get("apiVersion") == GROUP_VERSION and doc.get("kind") in ("TPUSyncPool", "DisaggregatedServing"):
                docs.append(doc)
    return docs


def _owner(doc: dict[str, Any]) -> Owner:
    meta = doc.get("metadata") or {}
    if not meta.get("name"):
        raise RenderError(f"a {doc['kind']} without metadata.name")
    return Owner(GROUP_VERSION, doc["kind"], meta["name"], meta.get("namespace") or "default", UID)


def _spec(model: type[BaseModel], doc: dict[str, Any]) -> Any:
    try:
        return model.model_validate(doc.get("spec") or {})
    except ValueError as e:
        raise RenderError(f"{doc['kind']} {doc.get('metadata', {}).get('name')}: {e}") from None


def render_pool(doc: dict[str, Any]) -> tuple[PoolInfo, list[Rendered]]:
    owner, spec = _owner(doc), _spec(TPUSyncPoolSpec, doc)
    where = f"TPUSyncPool {owner.namespace}/{owner.name}"
    try:
        plan = plan_pool(owner, spec)
    except PlanError as e:
        raise RenderError(f"{where}: {e}") from None
    out: list[Rendered] = []
    if spec.provisioning.mode == "gke":
        gke = spec.provisioning.gke
        cluster = ClusterRef(gke.project, gke.location, gke.cluster)
        for request in plan.node_pool_requests:
            out.append(Rendered([f"{where}: GKE node pool request (not a Kubernetes object)",
                                 f"POST {configured_endpoint(os.environ)}{cluster.parent}/nodePools"],
                                request.body))
    if not spec.auth.secret_name:
        secret = build_auth_secret(owner, spec, b"")
        secret["data"] = {"token": base64.b64encode(GENERATED.encode()).decode()}
        out.append(Rendered([f"{where}: created once if absent; data.token is {GENERATED}"], secret))
    out += [Rendered([where], obj) for obj in plan.apply]
    return PoolInfo(owner.name, spec, plan.tpu), out


def render_serving(doc: dict[str, Any], pools: dict[tuple[str, str], PoolInfo]) -> list[Rendered]:
    owner, spec = _owner(doc), _spec(DisaggregatedServingSpec, doc)
    where = f"DisaggregatedServing {owner.namespace}/{owner.name}"
    pool = pools.get((owner.namespace, spec.pool_ref.name))
    if pool is None:
        raise RenderError(f"{where}: spec.poolRef.name {spec.pool_ref.name!r}: no TPUSyncPool of that name in "
                          f"namespace {owner.namespace} in the files given")
    try:
        plan = plan_serving(owner, spec, pool, set(OPTIONAL_KINDS))
    except PlanError as e:
        raise RenderError(f"{where}: {e}") from None
    out: list[Rendered] = []
    if spec.engine.type == "sglang-jax":
        out.append(Rendered([f"{where}: created once if absent; data.secret is {GENERATED}"],
                            sglang_pd.build_secret(owner, GENERATED)))
    return out + [Rendered([where], obj) for obj in plan.apply]


def render(docs: list[dict[str, Any]]) -> list[Rendered]:
    """Pools first (a serving needs its pool's slice), then servings, each in file order."""
    pools: dict[tuple[str, str], PoolInfo] = {}
    out: list[Rendered] = []
    for doc in docs:
        if doc["kind"] == "TPUSyncPool":
            info, objs = render_pool(doc)
            pools[(_owner(doc).namespace, info.name)] = info
            out += objs
    for doc in docs:
        if doc["kind"] == "DisaggregatedServing":
            out += render_serving(doc, pools)
    return out


def dump(rendered: list[Rendered], stream: TextIO) -> None:
    for r in rendered:
        stream.write("---\n")
        for line in r.comment:
            stream.write(f"# {line}\n")
        stream.write(yaml.safe_dump(r.body, sort_keys=False, default_flow_style=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tpusync_operator render",
        description="Print every object the operator would create (and every GKE node pool it would request) "
                    "for the TPUSyncPool and DisaggregatedServing objects in FILEs, without a cluster.")
    parser.add_argument("files", nargs="+", metavar="FILE", help='YAML files ("-" for stdin)')
    args = parser.parse_args(argv)
    try:
        docs = load(args.files)
        if not docs:
            print("render: no TPUSyncPool or DisaggregatedServing in the files", file=sys.stderr)
            return 1
        dump(render(docs), sys.stdout)
    except (RenderError, OSError, yaml.YAMLError) as e:
        print(f"render: {e}", file=sys.stderr)
        return 1
    return 0
