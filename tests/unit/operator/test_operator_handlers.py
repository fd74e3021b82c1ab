"""kopf wiring: what the handlers do with watch events of what an object depends on, which
pools are GKE pools (a timer and a delete handler, so a finalizer), the kinds watched, and
the `python -m tpusync_operator` entry point.

That kopf calls the handlers as registered is not read from kopf's private registries here:
the e2e suite runs the real kopf against the real API server (create, update, resume after
a restart, drift of children, the finalizer only on GKE pools: e2e/test_operator.py,
e2e/test_operator_gke.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import kopf
import pytest
import yaml
from kubernetes_asyncio import config

from tpusync_operator import __main__ as entry
from tpusync_operator import handlers, render
from tpusync_operator.kube import RESOURCES

REPO = Path(__file__).resolve().parents[3]
SAMPLES = sorted((REPO / "samples").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"


def test_every_kind_the_builders_create_is_watched():
    """Drift of any child triggers a pass of its owner: every kind in the rendered samples and
    golden cases is in CHILD_RESOURCES, except the pool's auth Secret (created once, never
    re-applied)."""
    rendered = [r.body for r in render.render(render.load([str(p) for p in SAMPLES]))]
    golden = [d for f in GOLDEN.glob("*.yaml") for d in yaml.safe_load_all(f.read_text()) if d]
    kinds = {(o["apiVersion"], o["kind"]) for o in rendered + golden if "kind" in o} - {("v1", "Secret")}
    watched = {(f"{g}/{v}" if g else v, plural) for g, v, plural in handlers.CHILD_RESOURCES}
    for api_version, kind in sorted(kinds):
        plural, _ = RESOURCES[(api_version, kind)]
        assert (api_version, plural) in watched, kind
    assert len(kinds) >= 12   # the samples and cases render most kinds (not a vacuous loop)


class FakeQueue:
    def __init__(self):
        self.requested = []

    def request(self, key):
        self.requested.append(key)


def owned(kind, name, ns="ns"):
    return {"metadata": {"namespace": ns, "name": f"{name}-x", "ownerReferences": [
        {"apiVersion": "tpusync.dev/v1alpha1", "kind": kind, "name": name, "controller": True}]}}


def run(coro):
    return asyncio.run(coro)


def test_events_request_passes_of_the_objects_that_depend_on_them():
    memo = type("Memo", (), {})()
    memo.objects, memo.selectors, memo.pool_views, memo.passes = {}, {}, {}, FakeQueue()
    pool = {"metadata": {"namespace": "ns", "name": "p"},
            "spec": {"tpu": {"type": "v6e", "topology": "2x2"},
                     "provisioning": {"mode": "existing", "existing": {"nodePoolName": "np"}}}}
    serving = {"metadata": {"namespace": "ns", "name": "s"}, "spec": {"poolRef": {"name": "p"}}}
    other = {"metadata": {"namespace": "ns", "name": "o"}, "spec": {"poolRef": {"name": "q"}}}
    for body in (serving, other):
        run(handlers.serving_seen(event={"type": "ADDED"}, body=body, memo=memo))
    run(handlers.pool_seen(event={"type": "ADDED"}, body=pool, memo=memo))
    assert memo.passes.requested == [("DisaggregatedServing", "ns", "s")]      # not o (another pool)
    assert memo.selectors[("TPUSyncPool", "ns", "p")] == {"cloud.google.com/gke-nodepool": "np"}
    # Only the pool's capacity figures changed: its servings do not read them.
    run(handlers.pool_seen(event={"type": "MODIFIED"}, body={**pool, "status": {"readySidecars": 3}}, memo=memo))
    assert len(memo.passes.requested) == 1
    ready = {**pool, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    run(handlers.pool_seen(event={"type": "MODIFIED"}, body=ready, memo=memo))
    assert len(memo.passes.requested) == 2                                     # Ready changed

    memo.passes.requested.clear()
    run(handlers.child_seen(body=owned("DisaggregatedServing", "s"), memo=memo))
    run(handlers.child_seen(body=owned("TPUSyncPool", "p"), memo=memo))
    run(handlers.child_seen(body=owned("Deployment", "d"), memo=memo))                # not ours
    run(handlers.pool_pod_seen(body={"metadata": {"namespace": "ns", "labels": {"tpusync.dev/pool": "p"}}}, memo=memo))
    run(handlers.node_seen(body={"metadata": {"labels": {"cloud.google.com/gke-nodepool": "np"}}}, memo=memo))
    run(handlers.node_seen(body={"metadata": {"labels": {"cloud.google.com/gke-nodepool": "other"}}}, memo=memo))
    run(handlers.optional_crd_seen(memo=memo))
    assert memo.passes.requested == [("DisaggregatedServing", "ns", "s"), ("TPUSyncPool", "ns", "p"),
                                     ("TPUSyncPool", "ns", "p"), ("TPUSyncPool", "ns", "p"),
                                     ("DisaggregatedServing", "ns", "s"), ("DisaggregatedServing", "ns", "o")]

    run(handlers.pool_seen(event={"type": "DELETED"}, body=pool, memo=memo))
    assert ("TPUSyncPool", "ns", "p") not in memo.objects and not memo.selectors


def test_a_retry_touch_requests_a_pass_of_the_touched_object():
    """A replica retries a pass by touching the object; the event of the touch, seen by the
    active replica, requests the pass (the first sight of an object does not: kopf's resume
    handler runs that pass)."""
    memo = type("Memo", (), {})()
    memo.objects, memo.selectors, memo.pool_views, memo.passes = {}, {}, {}, FakeQueue()
    serving = {"metadata": {"namespace": "ns", "name": "s", "annotations": {handlers.RETRY_ANNOTATION: "t0"}},
               "spec": {"poolRef": {"name": "p"}}}
    run(handlers.serving_seen(event={"type": "ADDED"}, body=serving, memo=memo))
    run(handlers.serving_seen(event={"type": "MODIFIED"}, body=serving, memo=memo))
    assert memo.passes.requested == []
    touched = {**serving, "metadata": {**serving["metadata"], "annotations": {handlers.RETRY_ANNOTATION: "t1"}}}
    run(handlers.serving_seen(event={"type": "MODIFIED"}, body=touched, memo=memo))
    assert memo.passes.requested == [("DisaggregatedServing", "ns", "s")]


def test_gke_pools_are_told_apart_by_their_provisioning_mode():
    assert handlers._is_gke(spec={"provisioning": {"mode": "gke"}})
    assert not handlers._is_gke(spec={"provisioning": {"mode": "existing"}})
    assert not handlers._is_gke(spec={})


@pytest.mark.parametrize("argv,want", [
    ([], {"standalone": False, "peering_name": "tpusync-operator", "clusterwide": True, "namespaces": [],
          "liveness_endpoint": "http://0.0.0.0:8080/healthz"}),
    (["--standalone", "-n", "a", "-n", "b", "--liveness", "http://127.0.0.1:9/healthz"],
     {"standalone": True, "peering_name": None, "clusterwide": False, "namespaces": ["a", "b"],
      "liveness_endpoint": "http://127.0.0.1:9/healthz"}),
])
def test_entry_point_flags(monkeypatch, argv, want):
    seen = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: seen.update(kw))
    monkeypatch.setenv("TPUSYNC_METRICS_PORT", "0")
    assert entry.main(argv + ["--metrics-port", "0"]) == 0
    for k, v in want.items():
        assert seen[k] == v, k


def test_metrics_address_flag(monkeypatch):
    """Outside a pod (e2e, dev) the metrics server must be able to bind loopback only."""
    monkeypatch.setattr(kopf, "run", lambda **kw: None)
    monkeypatch.delenv("TPUSYNC_METRICS_ADDRESS", raising=False)
    assert entry.main(["--metrics-port", "0"]) == 0
    assert entry.os.environ["TPUSYNC_METRICS_ADDRESS"] == "0.0.0.0"
    assert entry.main(["--metrics-port", "0", "--metrics-address", "127.0.0.1"]) == 0
    assert entry.os.environ["TPUSYNC_METRICS_ADDRESS"] == "127.0.0.1"
    served = []
    monkeypatch.setattr(handlers.metrics, "serve", lambda port, address: served.append((port, address)))
    monkeypatch.setenv("TPUSYNC_METRICS_PORT", "9999")

    class Settings:   # just the attributes configure() sets
        class persistence:
            pass

        class posting:
            pass

        class watching:
            pass

        class background:
            pass

    class Memo:
        pass

    async def fake_load_kube_config():
        return None

    monkeypatch.setattr(config, "load_incluster_config", lambda: (_ for _ in ()).throw(config.ConfigException()))
    monkeypatch.setattr(config, "load_kube_config", fake_load_kube_config)
    memo = Memo()
    asyncio.run(handlers.configure(settings=Settings, memo=memo))
    asyncio.run(memo.api.close())
    assert served == [(9999, "127.0.0.1")]


@pytest.mark.parametrize("configured", ["default", "set"])
def test_the_operators_token_goes_only_to_the_gke_api_it_is_configured_with(monkeypatch, gke_server, configured):
    """A pool in mode gke naming an API endpoint of its own (spec.provisioning.gke.apiEndpoint,
    a field the CRD no longer has: the API server prunes it, and a strict client is refused)
    gets no request and no token: the operator's one GKE client is on TPUSYNC_GKE_ENDPOINT (the
    chart's gke.endpoint), or GKE's own endpoint when that is empty. Both are played by the
    GKE API contract server (harness/gke_api.py), which also serves the token."""
    from op_helpers import FakeKube, PoolBody

    from harness.gke_api import PARENT, serve
    from tpusync_operator import gke
    from tpusync_operator.reconcile_pool import reconcile_pool

    state, url = gke_server
    elsewhere, elsewhere_url, stop = serve()
    monkeypatch.setattr(config, "load_incluster_config", lambda: (_ for _ in ()).throw(config.ConfigException()))
    monkeypatch.setattr(config, "load_kube_config", _no_kube_config)
    monkeypatch.setenv("TPUSYNC_METRICS_PORT", "0")
    monkeypatch.setenv("TPUSYNC_METADATA_URL", url)
    if configured == "set":
        monkeypatch.setenv("TPUSYNC_GKE_ENDPOINT", url)
    else:
        monkeypatch.delenv("TPUSYNC_GKE_ENDPOINT", raising=False)
        monkeypatch.setattr(gke, "DEFAULT_ENDPOINT", url)       # GKE's own endpoint, played here
    body = PoolBody().gke(apiEndpoint=elsewhere_url).build()
    kube = FakeKube()
    kube.put(body)

    async def scenario():
        memo = kopf.Memo()
        await handlers.configure(settings=kopf.OperatorSettings(), memo=memo)
        try:
            memo.deps.kube, memo.deps.emit = kube, lambda *event: None
            with pytest.raises(kopf.TemporaryError):     # the node pool is being created
                await reconcile_pool(body, memo.deps)
        finally:
            await handlers.cleanup(memo=memo)

    try:
        asyncio.run(scenario())
    finally:
        stop()
    assert elsewhere.requests == []
    assert state.mutations() == [("POST", f"{PARENT}/nodePools")]
    assert {auth for _, path, auth in state.requests if path.startswith("/v1/")} == {"Bearer good"}


async def _no_kube_config():
    return None


def test_standalone_and_peering_are_exclusive():
    with pytest.raises(SystemExit):
        entry.main(["--standalone", "--peering", "x"])


def test_priority_auto_differs_per_process(monkeypatch):
    """Replicas of one Deployment get the same args: kopf pauses every peer that shares the
    highest priority, so `--priority auto` (the chart's default) must draw distinct values."""
    seen: list[int] = []
    monkeypatch.setattr(kopf, "run", lambda **kw: seen.append(kw["priority"]))
    for _ in range(20):
        assert entry.main(["--priority", "auto", "--metrics-port", "0"]) == 0
    assert entry.main(["--priority", "7", "--metrics-port", "0"]) == 0
    assert all(p >= 1 for p in seen[:-1]) and len(set(seen[:-1])) > 1 and seen[-1] == 7
    with pytest.raises(SystemExit):
        entry.main(["--priority", "high"])


def test_a_watch_of_a_removed_crd_waits_and_lists_again_instead_of_stopping_kopf(monkeypatch, caplog):
    """kopf stops the whole operator when a watch stream fails; a 404 (the CRD was removed, or
    is not served yet) must instead make the stream list again, as a new watcher would."""
    import inspect

    from kopf._cogs.clients import watching
    from kopf._cogs.clients.errors import APINotFoundError
    from kopf._core.reactor import queueing

    from tpusync_operator.removed_crds import tolerate_removed_crds

    # kopf's watcher must reach the stream through the module attribute that is wrapped.
    assert "watching.infinite_watch(" in inspect.getsource(queueing.watcher)
    calls: list[dict] = []

    async def kopf_stream(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            yield {"type": "ADDED", "object": {"n": 1}}
            raise APINotFoundError("404 page not found", status=404, headers={})
        yield {"type": "ADDED", "object": {"n": 2}}

    monkeypatch.setattr(watching, "infinite_watch", kopf_stream)
    tolerate_removed_crds(retry_seconds=0)
    tolerate_removed_crds(retry_seconds=0)      # idempotent: wrapped once

    async def consume():
        return [e async for e in watching.infinite_watch(resource="inferencepools", namespace=None)]

    with caplog.at_level(logging.WARNING, logger="tpusync_operator.removed_crds"):
        events = asyncio.run(consume())
    assert [e["object"]["n"] for e in events] == [1, 2]
    assert len(calls) == 2 and calls[1] == {"resource": "inferencepools", "namespace": None}
    assert "does not serve inferencepools" in caplog.text

    async def broken(**kwargs):
        raise RuntimeError("other errors still stop kopf")
        yield

    monkeypatch.setattr(watching, "infinite_watch", broken)
    tolerate_removed_crds(retry_seconds=0)
    with pytest.raises(RuntimeError):
        asyncio.run(consume())


@pytest.mark.parametrize("status,raised", [(0, kopf.TemporaryError), (503, kopf.TemporaryError), (404, None)])
def test_a_status_write_that_fails_is_retried_not_a_traceback(monkeypatch, status, raised):
    """The reconcilers hold every API error in the status; only writing the status can fail out
    of a pass (an outage): the pass comes again soon and nothing is logged as a crash. A 404 is
    the object deleted during the pass."""
    from tpusync_operator.kube import KubeError

    async def failing(body, deps):
        raise KubeError(status, "PATCH .../status: Server disconnected")
    monkeypatch.setitem(handlers.RECONCILERS, "TPUSyncPool", failing)
    memo = type("Memo", (), {})()
    memo.objects, memo.locks, memo.deps = {("TPUSyncPool", "ns", "p"): {"metadata": {"uid": "u"}}}, {}, None
    if raised is None:
        run(handlers._triggered(("TPUSyncPool", "ns", "p"), memo))
    else:
        with pytest.raises(raised) as e:
            run(handlers._triggered(("TPUSyncPool", "ns", "p"), memo))
        assert e.value.delay == handlers.STATUS_RETRY_SECONDS
