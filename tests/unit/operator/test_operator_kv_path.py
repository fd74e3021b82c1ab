"""A serving says whether its KV path really works: the operator reads its engines' own
counters (the runtime's tpusync.kv.path_metrics, rendered by the runtime itself here) and
judges what changed between two passes (tpusync_operator.kv_path, KVPath condition)."""

from __future__ import annotations

import asyncio

import pytest
from op_helpers import FakeKube, PoolBody, ServingBody

from tpusync.kv import path_metrics
from tpusync_operator import kv_path
from tpusync_operator.kv_path import EngineReading, KVPathObservation, kv_path_condition, parse_metrics
from tpusync_operator.models import KVCounters
from tpusync_operator.reconcile import Deps
from tpusync_operator.reconcile_serving import reconcile_serving
from tpusync_operator.status import Cond


def test_the_operator_reads_the_names_the_engines_write():
    """They meet on the wire: the same counters on both sides, and the status has a field for each."""
    assert kv_path.PREFIX == path_metrics.PREFIX and kv_path.OFF == path_metrics.OFF
    assert set(kv_path.COUNTERS) == set(path_metrics.COUNTERS) == set(KVCounters.model_fields)
    counters = path_metrics.PathCounters()
    counters.add(requests=3, handoffs=2, pulled_blocks=7)
    counters.switch_off("store-blocks-too-small")
    parsed = parse_metrics("# HELP vllm:x y\n# TYPE vllm:x gauge\nvllm:x 1\n"
                           + counters.prometheus({"model_name": 'a "b"'}))
    assert parsed is not None
    totals, off = parsed
    assert (totals["requests"], totals["handoffs"], totals["pulled_blocks"], totals["saved_blocks"]) == (3, 2, 7, 0)
    assert off == ("store-blocks-too-small",)


def test_metrics_without_the_counters_are_no_connector_and_bad_text_is_refused():
    assert parse_metrics("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n") is None
    with pytest.raises(ValueError):
        parse_metrics("tpusync_kv_requests_total{ 1\n")


def reading(role, pod="p", error="", off=(), **counts):
    if error:
        return EngineReading(pod, role, error=error)
    return EngineReading(pod, role, {k: counts.get(k, 0) for k in kv_path.COUNTERS}, tuple(off))


def decode_totals(**counts):
    return {"decode": {k: counts.get(k, 0) for k in kv_path.COUNTERS}}


def verdict(readings, previous=None, prior=None, disaggregated=True, observable=True):
    c = kv_path_condition(KVPathObservation(disaggregated, observable, readings, previous, prior))
    return c.status, c.reason


@pytest.mark.parametrize(("readings", "previous", "expected"), [
    ([reading("prefill", saved_blocks=4), reading("decode", requests=2, handoffs=2, pulled_blocks=8)], None,
     (True, "Pulling")),
    ([reading("decode", requests=2, handoffs=2, loaded_blocks=8)], None, (True, "Pulling")),   # held already
    ([reading("decode", requests=3, handoffs=3, pulled_blocks=8, pull_failures=1)], None, (False, "PullsFailing")),
    ([reading("decode", requests=1, handoffs=1, refused_handoffs=1)], None, (False, "HandoffsRefused")),
    ([reading("decode", requests=5)], None, (False, "NoHandoffs")),
    ([reading("decode", requests=2, handoffs=2)], None, (False, "NotPulling")),
    ([reading("decode", off=("store-blocks-too-small",))], None, (False, "ConnectorOff")),
    ([reading("prefill"), EngineReading("d", "decode")], None, (False, "NoConnector")),
    ([reading("decode", error="timed out")], None, (None, "NoEnginesRead")),
    ([], None, (None, "NoEnginesRead")),
    ([reading("decode")], None, (None, "NoTraffic")),
    # Only what changed since the last pass counts: an old failure does not stay a failure ...
    ([reading("decode", requests=9, handoffs=9, pulled_blocks=30, pull_failures=1)],
     decode_totals(requests=4, handoffs=4, pulled_blocks=10, pull_failures=1), (True, "Pulling")),
    # ... and a total that fell (a pod restarted) counts from zero.
    ([reading("decode", requests=1, handoffs=1)], decode_totals(requests=9, handoffs=9, pulled_blocks=30),
     (False, "NotPulling")),
])
def test_the_verdict_on_what_the_engines_did(readings, previous, expected):
    assert verdict(readings, previous) == expected


def test_no_traffic_keeps_the_last_traffics_verdict_but_not_a_stale_fault():
    same = decode_totals(requests=2, handoffs=2, pulled_blocks=8)
    now = [reading("decode", requests=2, handoffs=2, pulled_blocks=8)]
    assert verdict(now, same, Cond("KVPath", False, "PullsFailing", "x")) == (False, "PullsFailing")
    assert verdict(now, same, Cond("KVPath", False, "NoConnector", "x")) == (None, "NoTraffic")
    assert verdict([], None, disaggregated=False) == (None, "NotDisaggregated")
    assert verdict([], None, observable=False) == (None, "NotObservable")


def serving_pod(name, role, ip, ready=True):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns",
                         "labels": {"tpusync.dev/serving": "llm", "tpusync.dev/role": role,
                                    "llm-d.ai/inference-serving": "true"}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_a_pass_reads_every_ready_serving_pod_and_reports_the_kv_path(clock):
    kube = FakeKube()
    kube.put(PoolBody().spec(capacity={"hosts": 2}).ready().build())
    kube.put(serving_pod("llm-prefill-0", "prefill", "10.0.0.1"))
    kube.put(serving_pod("llm-decode-0", "decode", "10.0.0.2"))
    kube.put(serving_pod("llm-decode-1", "decode", "10.0.0.3", ready=False))   # not read: no traffic reaches it
    engines = {"10.0.0.1": path_metrics.PathCounters(), "10.0.0.2": path_metrics.PathCounters()}
    asked = []

    async def read_text(url):
        asked.append(url)
        host = url.split("//")[1].split(":")[0]
        if host not in engines:
            raise OSError("connection refused")
        return engines[host].prometheus()

    d = Deps(kube=kube, now=clock, token=lambda: b"t", emit=lambda *a: None, read_text=read_text)
    body = ServingBody().build()
    kube.put(body)

    def run_pass():
        obj = kube.find("DisaggregatedServing", "llm")
        status = asyncio.run(reconcile_serving(obj, d))
        return status, {c["type"]: c for c in status["conditions"]}["KVPath"]

    status, cond = run_pass()
    assert sorted(asked) == ["http://10.0.0.1:8000/metrics", "http://10.0.0.2:8000/metrics"]
    assert (cond["status"], cond["reason"]) == ("Unknown", "NoTraffic")
    assert status["kvPath"]["enginesRead"] == 2 and status["kvPath"]["decode"]["requests"] == 0

    engines["10.0.0.1"].add(requests=3, saved_blocks=12)
    engines["10.0.0.2"].add(requests=3, handoffs=3, pulled_blocks=12, loaded_blocks=12)
    status, cond = run_pass()
    assert (cond["status"], cond["reason"]) == ("True", "Pulling") and "12 blocks pulled" in cond["message"]
    assert status["kvPath"]["decode"]["pulledBlocks"] == 12 and status["kvPath"]["prefill"]["savedBlocks"] == 12

    status, cond = run_pass()   # no traffic since: still Pulling
    assert (cond["status"], cond["reason"]) == ("True", "Pulling")

    engines["10.0.0.2"].add(requests=1, handoffs=1, pull_failures=1, recomputed_blocks=4)
    status, cond = run_pass()
    assert (cond["status"], cond["reason"]) == ("False", "PullsFailing")

    del engines["10.0.0.1"]     # the prefill pod stops answering: its counters are unknown, not zero
    status, cond = run_pass()
    assert status["kvPath"]["enginesUnread"] == 1 and status["kvPath"]["enginesRead"] == 1
