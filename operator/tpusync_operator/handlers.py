"""kopf registration: one reconcile per kind, run on the object's create/update/resume and
on watch events of what its status and children depend on; probes; operator settings.

What triggers a pass of an object, besides its own spec changes:
- an event of one of its children (drift: a child edited or deleted, a workload's readiness);
- for a pool: its pods (sidecar readiness) and the nodes its node selector picks;
- for a serving: its pool (spec or Ready) and the optional CRDs it uses (installed later), and
  every KV_PATH_INTERVAL, to read its engines' KV-path counters.
A triggered pass that must come back is retried through a `RETRY_ANNOTATION` touch (see
passes.py), which the object's own event handler turns into a pass.
Only pools in mode gke carry the finalizer FINALIZER: they own a cloud node pool, deleted by
`pool_deleted`, and GKE's state is polled by a timer (kopf timers require a finalizer).
Other objects have no finalizer, so deleting them never waits for the operator."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import kopf

from . import GROUP, VERSION, metrics
from .builders.common import MANAGED_BY, POOL_LABEL, SERVING_LABEL
from .builders.pool import pool_node_selector
from .events import EventPoster
from .gke import GKEClient, MetadataServerToken, configured_endpoint, configured_metadata_url
from .kube import ApiKube, KubeError
from .models import TPUSyncPoolSpec
from .nodepools import delete_pool
from .passes import PassQueue, owner_key, set_owner_key
from .pool_plan import check_pool
from .reconcile import Deps
from .reconcile_pool import reconcile_pool
from .reconcile_serving import reconcile_serving
from .serving_plan import OPTIONAL_KINDS
from .status import utc_now
from .versions import DISAGGREGATEDSET_API, image_registry

TIMER_INTERVAL = float(os.environ.get("TPUSYNC_RESYNC_SECONDS", "30"))
KV_PATH_INTERVAL = float(os.environ.get("TPUSYNC_KV_PATH_SECONDS", "30"))
FINALIZER = "tpusync.dev/operator"
STATUS_RETRY_SECONDS = 5.0
RETRY_ANNOTATION = "tpusync.dev/retry"


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    from kubernetes_asyncio import client, config
    try:   # TPUSYNC_IMAGE_REGISTRY (the chart's imageRegistry): refused before any pass renders an image
        image_registry(os.environ)
    except ValueError as e:
        raise kopf.PermanentError(str(e)) from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    api = client.ApiClient()
    # One GKE client, on the endpoint of the operator's configuration: the access token it
    # carries never goes where a TPUSyncPool says.
    tokens = MetadataServerToken(configured_metadata_url(os.environ))
    gke = GKEClient(tokens, configured_endpoint(os.environ))
    kube = ApiKube(api)
    memo.events = EventPoster(kube, utc_now)
    memo.deps = Deps(kube=kube, emit=memo.events.emit, gke=gke)
    memo.api = api
    memo.gke = (gke, tokens)
    memo.locks = {}
    memo.objects = {}      # (kind, namespace, name) -> latest body, from the watch streams
    memo.selectors = {}    # pool key -> its node selector
    memo.pool_views = {}   # pool key -> (generation, Ready) its servings last saw
    memo.passes = PassQueue[tuple[str, str, str]](lambda key: _triggered(key, memo), lambda key: _touch(key, memo))
    settings.persistence.finalizer = FINALIZER
    # Keep kopf's bookkeeping out of .status (ours is written by the reconcilers).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.tpusync.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kopf.tpusync.dev", key="last-handled-configuration")
    # kopf's own log lines become events only from WARNING up (failed or retried handlers);
    # at INFO every timer pass would post one. Our transitions are posted by the reconcilers.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # Deleting an object stops its timer; if a pass is running at that moment, kopf re-checks
    # whether the timer has exited after this many seconds (default 60) before it releases the
    # finalizer. A pass takes seconds, so poll often rather than hold deletions for a minute.
    settings.background.cancellation_polling = 1
    memo.kv_path_task = asyncio.create_task(_observe_kv_paths(memo), name="tpusync-kv-path")
    metrics_port = int(os.environ.get("TPUSYNC_METRICS_PORT", "0") or 0)
    if metrics_port:
        metrics.serve(metrics_port, os.environ.get("TPUSYNC_METRICS_ADDRESS", "0.0.0.0"))


async def _observe_kv_paths(memo: kopf.Memo) -> None:
    """A pass of every serving each KV_PATH_INTERVAL: the engines' KV-path counters change with
    traffic, which no watch event announces (status.kvPath, the KVPath condition). No timer:
    kopf's timers need a finalizer, and deleting a serving never waits for the operator."""
    while True:
        await asyncio.sleep(KV_PATH_INTERVAL)
        for key in list(memo.objects):
            if key[0] == "DisaggregatedServing":
                memo.passes.request(key)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    task = getattr(memo, "kv_path_task", None)
    if task is not None:
        task.cancel()
    if getattr(memo, "passes", None) is not None:
        memo.passes.close()
    if getattr(memo, "events", None) is not None:
        await memo.events.drain()     # the last passes' events, before the client closes
    api = getattr(memo, "api", None)
    if api is not None:
        await api.close()
    for gke_client in getattr(memo, "gke", ()):
        await gke_client.aclose()


@kopf.on.probe(id="reconcilers")
def probe(memo: kopf.Memo, **_: Any) -> str:
    return "ready" if getattr(memo, "deps", None) is not None else "starting"


async def _run(kind: str, fn: Any, body: kopf.Body, memo: kopf.Memo) -> None:
    """Serialise passes per object (a timer may fire while an update is handled)."""
    lock = memo.locks.setdefault(body["metadata"]["uid"], asyncio.Lock())
    started = time.monotonic()
    result = "ok"
    try:
        async with lock:
            status = await fn(dict(body), memo.deps)
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status["conditions"])
        metrics.READY.labels(kind, body["metadata"]["namespace"], body["metadata"]["name"]).set(1 if ready else 0)
    except kopf.TemporaryError:
        result = "retry"
        raise
    except kopf.PermanentError:
        result = "invalid"
        raise
    except Exception:
        result = "error"
        raise
    finally:
        metrics.RECONCILES.labels(kind, result).inc()
        metrics.RECONCILE_SECONDS.labels(kind).observe(time.monotonic() - started)


RECONCILERS = {"TPUSyncPool": reconcile_pool, "DisaggregatedServing": reconcile_serving}


async def _triggered(key: tuple[str, str, str], memo: kopf.Memo) -> None:
    body = memo.objects.get(key)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    try:
        await _run(key[0], RECONCILERS[key[0]], body, memo)
    except KubeError as e:
        if e.status == 404:     # the status write found the object deleted during the pass
            return
        # The status write itself failed (the reconcilers hold every other API error in the
        # status): an outage, not a bug, so a line in the log and a pass again soon.
        logging.getLogger(__name__).warning("%s %s/%s: status not written: %s", *key, e)
        raise kopf.TemporaryError(f"status not written: {e}", delay=STATUS_RETRY_SECONDS) from e


async def _touch(key: tuple[str, str, str], memo: kopf.Memo) -> None:
    kind, namespace, name = key
    try:
        await memo.deps.kube.annotate(f"{GROUP}/{VERSION}", kind, namespace, name,
                                      {RETRY_ANNOTATION: memo.deps.now().isoformat()})
    except KubeError as e:
        if e.status != 404:     # deleted meanwhile: nothing to retry
            raise


def _retry_mark(body: Mapping[str, Any]) -> str | None:
    return (body["metadata"].get("annotations") or {}).get(RETRY_ANNOTATION)


def _remember(kind: str, event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo) -> tuple[str, str, str]:
    """Keep the latest body; a new retry mark (a touch, by any replica) requests a pass."""
    key = (kind, body["metadata"]["namespace"], body["metadata"]["name"])
    old = memo.objects.get(key)
    if event["type"] == "DELETED":
        memo.objects.pop(key, None)
        return key
    memo.objects[key] = dict(body)
    if old is not None and _retry_mark(old) != _retry_mark(body):
        memo.passes.request(key)
    return key


# --------------------------------------------------------------- TPUSyncPool

@kopf.on.resume(GROUP, VERSION, "tpusyncpools")
@kopf.on.create(GROUP, VERSION, "tpusyncpools")
@kopf.on.update(GROUP, VERSION, "tpusyncpools", field="spec")
async def pool_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _run("TPUSyncPool", reconcile_pool, body, memo)


def _is_gke(spec: kopf.Spec, **_: Any) -> bool:
    return (spec.get("provisioning") or {}).get("mode") == "gke"


@kopf.timer(GROUP, VERSION, "tpusyncpools", interval=TIMER_INTERVAL, initial_delay=TIMER_INTERVAL, idle=5,
            when=_is_gke)
async def pool_timer(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _run("TPUSyncPool", reconcile_pool, body, memo)


# Only pools that own a cloud resource run a delete handler (the `when` filter).
@kopf.on.delete(GROUP, VERSION, "tpusyncpools", when=_is_gke)
async def pool_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await delete_pool(dict(body), memo.deps)


@kopf.on.event(GROUP, VERSION, "tpusyncpools")
async def pool_seen(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Remember the pool. When its spec or its Ready condition changes, derive its node
    selector again and trigger its servings: they read those, not its capacity figures, which
    change with every sidecar that becomes ready."""
    key = _remember("TPUSyncPool", event, body, memo)
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (body.get("status") or {}).get("conditions", []))
    view = None if event["type"] == "DELETED" else (body["metadata"].get("generation"), ready)
    if key in memo.pool_views and memo.pool_views[key] == view:
        return
    memo.selectors.pop(key, None)
    if view is None:
        memo.pool_views.pop(key, None)
    else:
        memo.pool_views[key] = view
        try:
            spec = TPUSyncPoolSpec.model_validate(body.get("spec") or {})
            memo.selectors[key] = pool_node_selector(key[2], key[1], spec, check_pool(spec))
        except ValueError:      # an invalid spec (ValidationError, PlanError): its own pass reports it
            pass
    for kind, ns, name in list(memo.objects):
        if kind == "DisaggregatedServing" and ns == key[1] and key[2] in _pools_named(memo.objects[(kind, ns, name)]):
            memo.passes.request((kind, ns, name))


def _pools_named(serving: dict[str, Any]) -> set[str]:
    """The pools a serving's spec names: spec.poolRef and each role's own."""
    spec = serving.get("spec") or {}
    refs = (spec.get("poolRef"), (spec.get("prefill") or {}).get("poolRef"), (spec.get("decode") or {}).get("poolRef"))
    return {str(ref["name"]) for ref in refs if ref and ref.get("name")}


@kopf.on.event("", "v1", "pods", labels={POOL_LABEL: kopf.PRESENT})
async def pool_pod_seen(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.passes.request(("TPUSyncPool", body["metadata"]["namespace"], body["metadata"]["labels"][POOL_LABEL]))


@kopf.on.event("", "v1", "nodes")
async def node_seen(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    labels = body["metadata"].get("labels") or {}
    for key, selector in list(memo.selectors.items()):
        if selector and all(labels.get(k) == v for k, v in selector.items()):
            memo.passes.request(key)


# ------------------------------------------------------- DisaggregatedServing

@kopf.on.resume(GROUP, VERSION, "disaggregatedservings")
@kopf.on.create(GROUP, VERSION, "disaggregatedservings")
@kopf.on.update(GROUP, VERSION, "disaggregatedservings", field="spec")
async def serving_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _run("DisaggregatedServing", reconcile_serving, body, memo)


@kopf.on.event(GROUP, VERSION, "disaggregatedservings")
async def serving_seen(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _remember("DisaggregatedServing", event, body, memo)


OPTIONAL_CRDS = {f"{plural}.{api.split('/')[0]}" for api, plural in OPTIONAL_KINDS.values()}


@kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions",
               when=lambda name, **_: name in OPTIONAL_CRDS)
async def optional_crd_seen(memo: kopf.Memo, **_: Any) -> None:
    """A serving degraded by a missing CRD recovers when it is installed (and notices removal)."""
    for key in list(memo.objects):
        if key[0] == "DisaggregatedServing":
            memo.passes.request(key)


# ------------------------------------------------------- children (both kinds)

# Every kind the builders create, except the pool's auth Secret: it is created once and never
# re-applied, and watching Secrets would need the right to read every Secret in the cluster.
CHILD_RESOURCES = [
    ("", "v1", "configmaps"), ("", "v1", "services"), ("", "v1", "serviceaccounts"),
    ("", "v1", "persistentvolumeclaims"),
    ("apps", "v1", "deployments"), ("apps", "v1", "statefulsets"), ("apps", "v1", "daemonsets"),
    ("networking.k8s.io", "v1", "networkpolicies"), ("policy", "v1", "poddisruptionbudgets"),
    ("rbac.authorization.k8s.io", "v1", "roles"), ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    *((api.split("/")[0], api.split("/")[1], plural) for api, plural in OPTIONAL_KINDS.values()),
]


async def child_seen(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    key = owner_key(body["metadata"], GROUP, tuple(RECONCILERS)) or \
        set_owner_key(body["metadata"], DISAGGREGATEDSET_API.split("/")[0], SERVING_LABEL)
    if key is not None:
        memo.passes.request(key)


for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(_group, _version, _plural, id=f"child_seen/{_plural}",
                  labels={"app.kubernetes.io/managed-by": MANAGED_BY})(child_seen)
