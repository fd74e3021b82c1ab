"""`python -m tpusync_operator render FILE...`: every object the operator would create, and
every GKE node pool it would request, for the TPUSyncPool and DisaggregatedServing objects in
the files, printed as YAML documents without a cluster (like `helm template`).

The objects are first validated as the API server would (validate.py: the CRDs' schema and CEL
rules, unknown fields refused); then the operator's own planner runs on them as the API server
would store them (the models apply the CRD defaults), assuming every optional CRD
(LeaderWorkerSet, InferencePool, ...) is installed. Every error is reported, each with its
object and field. `validate FILE...` stops there and prints nothing else. What only a
cluster decides is marked in comments: the owner's uid, the random contents of the Secrets the operator generates once.

A serving's TPUSyncPool not in the files is read from a cluster (cluster_pools.py, --cluster);
with none, `validate` reports the serving's checks that need its pool as not run and exits 3.
An object of one of our kinds in another group, or in a group that is a near-miss of ours, is
an error, not a foreign object to skip.
"""

from __future__ import annotations

import argparse
import base64
import difflib
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
from .cluster_pools import MODES, ClusterReadError, Source, choose, default_namespace, read_pools
from .gke import ClusterRef, configured_endpoint
from .models import DisaggregatedServingSpec, TPUSyncPoolSpec
from .pool_plan import PlanError, plan_pool
from .serving_plan import OPTIONAL_KINDS, plan_serving, pool_refs, role_pools

GROUP_VERSION = "tpusync.dev/v1alpha1"
GROUP = GROUP_VERSION.split("/")[0]
KINDS = ("TPUSyncPool", "DisaggregatedServing")
NOT_RUN_EXIT = 3   # validate: no error found, but checks that need a serving's pool not run
UID = "<uid>"   # assigned by the API server
GENERATED = "<generated once by the operator: 32 random bytes>"


class RenderError(ValueError):
    """An input the operator would refuse, with the object and field named."""


@dataclass
class Rendered:
    """One output document: the object (or request body) and the comment lines above it."""
    comment: list[str]
    body: dict[str, Any]


def ours(doc: dict[str, Any]) -> bool:
    """A tpusync.dev object, or meant to be one: one of our kinds in any group, or any kind in a
    group that is a near-miss of ours (tpusync.io, tpusnyc.dev): validation refuses those,
    where skipping them would pass an object nothing checked."""
    group = str(doc.get("apiVersion", "")).split("/")[0].lower()
    return (group == GROUP or str(doc.get("kind", "")).lower() in {k.lower() for k in KINDS}
            or group.split(".")[0] == GROUP.split(".")[0] or difflib.SequenceMatcher(None, group, GROUP).ratio() >= 0.8)


def load(paths: Iterable[str], skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Every tpusync.dev object in the files ("-" reads stdin), in order (another kind or
    version of the group too, and what `ours` takes for a mistyped one: validation refuses it).
    What is not of the group is listed in `skipped`."""
    docs: list[dict[str, Any]] = []
    for path in paths:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            if not isinstance(doc, dict):
                raise RenderError(f"{path}: a YAML document that is not an object: {str(doc)[:60]!r}")
            if ours(doc):
                docs.append(doc)
            elif skipped is not None:
                skipped.append(f"{path}: {doc.get('apiVersion')} {doc.get('kind')} "
                               f"{(doc.get('metadata') or {}).get('name')}")
    return docs


def _where(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    return f"{doc.get('kind')} {meta.get('namespace') or 'default'}/{meta.get('name')}"


def check(docs: list[dict[str, Any]], source: Source | None = None, not_run: list[str] | None = None) -> list[str]:
    """Every error in the objects, schema and CEL first, then (for the objects that pass) the
    planner's; each line names the object and the field. A serving's pool not in the files is
    read from `source`; where there is none, the serving's planner checks are listed in
    `not_run` when given (an error otherwise)."""
    from .validate import validate  # CEL's runtime: only where objects are validated, not in the engine tiers

    errors = [f"{_where(doc)}: {e}" for doc in docs for e in validate(doc)[1]]
    if not errors:
        try:
            render(docs, source, not_run)
        except RenderError as e:
            errors.append(str(e))
    return errors


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


def render_serving(doc: dict[str, Any], pools: dict[tuple[str, str], PoolInfo], source: Source | None = None,
                   not_run: list[str] | None = None) -> list[Rendered]:
    """The serving's objects on its pools; a pool `pools` lacks was looked for in `source` (the
    cluster read, or none): its planner checks are then listed in `not_run`, when given."""
    owner, spec = _owner(doc), _spec(DisaggregatedServingSpec, doc)
    where = f"DisaggregatedServing {owner.namespace}/{owner.name}"
    by_name: dict[str, PoolInfo] = {}
    for name, field in pool_refs(spec).items():
        if (owner.namespace, name) in pools:
            by_name[name] = pools[(owner.namespace, name)]
            continue
        missing = f"{field} {name!r}: no TPUSyncPool of that name in namespace {owner.namespace} in the files given"
        if source is not None and source.mode != "none":
            raise RenderError(f"{where}: {missing} nor in {source.describe()}")
        why = source.why if source is not None else "--cluster none"
        if not_run is None:
            raise RenderError(f"{where}: {missing}, and no cluster to read it from ({why})")
        not_run.append(f"{where}: the checks that need its TPUSyncPool {owner.namespace}/{name} ({field}) were "
                       f"not run: not in the files given, and no cluster to read it from ({why})")
        return []
    try:
        plan = plan_serving(owner, spec, by_name[spec.pool_ref.name], set(OPTIONAL_KINDS), role_pools(spec, by_name))
    except PlanError as e:
        raise RenderError(f"{where}: {e}") from None
    out: list[Rendered] = []
    if spec.engine.type == "sglang-jax":
        out.append(Rendered([f"{where}: created once if absent; data.secret is {GENERATED}"],
                            sglang_pd.build_secret(owner, GENERATED)))
    return out + [Rendered([where], obj) for obj in plan.apply]


def render(docs: list[dict[str, Any]], source: Source | None = None,
           not_run: list[str] | None = None) -> list[Rendered]:
    """Pools first (a serving needs its pool's slice), then servings, each in file order. The
    pools that servings name and the files lack are read from `source`, checked as the operator
    checks a serving's pool, and not rendered (they are not the files')."""
    pools: dict[tuple[str, str], PoolInfo] = {}
    out: list[Rendered] = []
    for doc in docs:
        if doc["kind"] == "TPUSyncPool":
            info, objs = render_pool(doc)
            pools[(_owner(doc).namespace, info.name)] = info
            out += objs
    servings = [doc for doc in docs if doc["kind"] == "DisaggregatedServing"]
    if source is not None:
        wanted = sorted({(_owner(doc).namespace, name) for doc in servings
                         for name in pool_refs(_spec(DisaggregatedServingSpec, doc))} - pools.keys())
        try:
            read = read_pools(source, wanted)
        except ClusterReadError as e:
            raise RenderError(str(e)) from None
        for body in read.values():
            if body is not None:
                try:
                    info, _ = render_pool(body)
                except RenderError as e:
                    raise RenderError(f"{e} (read from {source.describe()})") from None
                pools[(_owner(body).namespace, info.name)] = info
    for doc in servings:
        out += render_serving(doc, pools, source, not_run)
    return out


def dump(rendered: list[Rendered], stream: TextIO) -> None:
    for r in rendered:
        stream.write("---\n")
        for line in r.comment:
            stream.write(f"# {line}\n")
        stream.write(yaml.safe_dump(r.body, sort_keys=False, default_flow_style=False))


def main(argv: list[str] | None = None, *, command: str = "render") -> int:
    """`render` (validate, then print the objects) or `validate` (only report)."""
    describe = {
        "render": "Validate the TPUSyncPool and DisaggregatedServing objects in FILEs as the API server would, "
                  "then print every object the operator would create for them (and every GKE node pool it "
                  "would request), without a cluster.",
        "validate": "Check the TPUSyncPool and DisaggregatedServing objects in FILEs as the API server would "
                    "(the CRDs' schema and CEL rules, unknown fields refused) and as the operator would (the "
                    "planner's checks); print every error with its object and field, or nothing.",
    }
    parser = argparse.ArgumentParser(prog=f"python -m tpusync_operator {command}", description=describe[command])
    parser.add_argument("files", nargs="+", metavar="FILE", help='YAML files ("-" for stdin)')
    parser.add_argument("--cluster", choices=MODES, default="auto",
                        help="where to read a serving's TPUSyncPool that the files lack: auto (a kubeconfig if "
                             "there is one, else the pod's service account in a pod, else none), kubeconfig, "
                             "in-cluster, none")
    parser.add_argument("--kubeconfig", help="the kubeconfig for --cluster auto/kubeconfig (default $KUBECONFIG, "
                                             "else ~/.kube/config)")
    parser.add_argument("--context", help="the kubeconfig context (default its current-context)")
    parser.add_argument("--namespace", "-n",
                        help="the namespace of objects without metadata.namespace, as kubectl's -n (default: the "
                             "kubeconfig context's namespace, in a pod its own, else default)")
    parser.epilog = ("Exit status: 0 all checked, no error; 1 errors (or unreadable input or cluster); 2 usage; "
                     f"{NOT_RUN_EXIT} (validate) no error, but a serving's pool was neither in the files nor in a "
                     "cluster, so the checks that need it were not run.")
    args = parser.parse_args(argv)
    try:
        skipped: list[str] = []
        docs = load(args.files, skipped)
        for s in skipped:
            print(f"{command}: skipped {s} (not a {GROUP} object)", file=sys.stderr)
        if not docs:
            print(f"{command}: no TPUSyncPool or DisaggregatedServing in the files", file=sys.stderr)
            return 1
        source = choose(args.cluster, args.kubeconfig, args.context)
        namespace = args.namespace or default_namespace(source)
        for doc in docs:   # where kubectl apply would put them
            meta = doc.setdefault("metadata", {}) if isinstance(doc.get("metadata", {}), dict) else None
            if meta is not None and not meta.get("namespace"):
                meta["namespace"] = namespace
        not_run: list[str] | None = [] if command == "validate" else None
        errors = check(docs, source, not_run)
        for e in errors:
            print(f"{command}: {e}", file=sys.stderr)
        for n in not_run or []:
            print(f"{command}: {n}", file=sys.stderr)
        if errors:
            return 1
        if not_run:
            return NOT_RUN_EXIT
        if command == "render":
            dump(render(docs, source), sys.stdout)
    except (RenderError, ClusterReadError, OSError, yaml.YAMLError) as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 1
    return 0
