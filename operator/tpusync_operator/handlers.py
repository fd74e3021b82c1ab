"""kopf registration: one reconcile for create/update/resume/timer per kind, a delete
handler only for GKE-provisioned pools, probes, and operator settings (peering, storage).

kopf holds its finalizer on every object that has a timer (the periodic resync), so each
TPUSyncPool and DisaggregatedServing carries FINALIZER while the operator runs; only pools
in mode gke run a handler when it is released."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import kopf

from . import GROUP, VERSION
from . import metrics
from .gke import GKEClient, MetadataServerToken
from .kube import ApiKube
from .reconcile import Deps, delete_pool, reconcile_pool, reconcile_serving

TIMER_INTERVAL = float(os.environ.get("TPUSYNC_RESYNC_SECONDS", "30"))
FINALIZER = "tpusync.dev/operator"


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    from kubernetes_asyncio import client, config
    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    api = client.ApiClient()
    tokens = MetadataServerToken(os.environ.get("TPUSYNC_METADATA_URL", "http://metadata.google.internal"))
    clients: dict[str, GKEClient] = {}

    def gke(endpoint: str) -> GKEClient:
        endpoint = os.environ.get("TPUSYNC_GKE_ENDPOINT", endpoint)
        if endpoint not in clients:
            clients[endpoint] = GKEClient(tokens, endpoint)
        return clients[endpoint]

    memo.deps = Deps(kube=ApiKube(api), gke=gke)
    memo.api = api
    memo.locks = {}
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
    metrics_port = int(os.environ.get("TPUSYNC_METRICS_PORT", "0") or 0)
    if metrics_port:
        metrics.serve(metrics_port, os.environ.get("TPUSYNC_METRICS_ADDRESS", "0.0.0.0"))


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    api = getattr(memo, "api", None)
    if api is not None:
        await api.close()


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


# --------------------------------------------------------------- TPUSyncPool

@kopf.on.resume(GROUP, VERSION, "tpusyncpools")
@kopf.on.create(GROUP, VERSION, "tpusyncpools")
@kopf.on.update(GROUP, VERSION, "tpusyncpools", field="spec")
async def pool_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _run("TPUSyncPool", reconcile_pool, body, memo)


@kopf.timer(GROUP, VERSION, "tpusyncpools", interval=TIMER_INTERVAL, initial_delay=TIMER_INTERVAL, idle=5)
async def pool_timer(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _run("TPUSyncPool", reconcile_pool, body, memo)


def _is_gke(spec: kopf.Spec, **_: Any) -> bool:
    return (spec.get("provisioning") or {}).get("mode") == "gke"


# Only pools that own a cloud resource run a delete handler (the `when` filter).
@kopf.on.delete(GROUP, VERSION, "tpusyncpools", when=_is_gke)
async def pool_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await delete_pool(dict(body), memo.deps)


# ------------------------------------------------------- DisaggregatedServing

@kopf.on.resume(GROUP, VERSION, "disaggregatedservings")
@kopf.on.create(GROUP, VERSION, "disaggregatedservings")
@kopf.on.update(GROUP, VERSION, "disaggregatedservings", field="spec")
async def serving_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _run("DisaggregatedServing", reconcile_serving, body, memo)


@kopf.timer(GROUP, VERSION, "disaggregatedservings", interval=TIMER_INTERVAL, initial_delay=TIMER_INTERVAL, idle=5)
async def serving_timer(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _run("DisaggregatedServing", reconcile_serving, body, memo)
