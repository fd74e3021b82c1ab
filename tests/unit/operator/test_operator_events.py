"""The reconcile passes' events, posted by the operator itself (events.py) from any task.

The CI's e2e run caught a pass started outside a kopf handler (the KV-path observer's) that
failed a write and then raised LookupError from kopf.event, which reads its queue from a
handler's context. These passes run in a plain asyncio task, as those do."""

from __future__ import annotations

import asyncio
import logging

import kopf
import pytest
from op_helpers import FakeKube, PoolBody

from tpusync_operator.events import MAX_MESSAGE, EventPoster, event_body
from tpusync_operator.kube import KubeError
from tpusync_operator.reconcile import Deps
from tpusync_operator.reconcile_pool import reconcile_pool


def events(kube):
    return [o for (_, kind, _, _), o in kube.objects.items() if kind == "Event"]


def test_a_failed_pass_outside_any_kopf_handler_posts_its_warning(kube, clock):
    """A child's apply refused with 409 (deleted between the read and the write, as in the
    e2e run) holds the pass; its APIError event is posted about the pool, not lost in a
    LookupError."""
    body = PoolBody().spec(capacity={"hosts": 2}).build()
    kube.put(body)
    kube.faults[("apply", "Service")] = KubeError(
        409, 'uid mismatch: the provided object specified uid u1, and no existing object was found',
        "PATCH /api/v1/namespaces/ns/services/pool-peers")

    async def scenario():
        poster = EventPoster(kube, clock, instance="operator-0")
        with pytest.raises(kopf.TemporaryError):
            await reconcile_pool(body, Deps(kube=kube, emit=poster.emit, now=clock, token=lambda: b"t"))
        await poster.drain()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    [event] = events(kube)
    assert event["reason"] == "APIError" and event["type"] == "Warning"
    assert "uid mismatch" in event["message"] and "pool-peers" in event["message"]
    assert event["involvedObject"] == {"apiVersion": "tpusync.dev/v1alpha1", "kind": "TPUSyncPool",
                                       "namespace": "ns", "name": "pool", "uid": body["metadata"]["uid"]}
    assert event["metadata"]["namespace"] == "ns" and event["metadata"]["name"].startswith("pool.")
    assert event["reportingInstance"] == "operator-0" and event["source"] == {"component": "tpusync-operator"}
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2026-01-02T03:04:05Z" and event["count"] == 1


def test_two_events_of_one_object_at_one_instant_are_both_kept(clock):
    body = PoolBody().build()
    first, second = (event_body(body, "Normal", "Ready", "m", clock(), "i") for _ in range(2))
    assert first["metadata"]["name"] != second["metadata"]["name"]


def test_a_long_message_is_cut_to_what_the_api_server_accepts(clock):
    event = event_body(PoolBody().build(), "Warning", "APIError", "x" * 5000, clock(), "i")
    assert len(event["message"]) == MAX_MESSAGE and event["message"].endswith("...")


def test_a_post_that_fails_is_a_warning_never_a_failed_pass(clock, caplog):
    kube = FakeKube()
    kube.faults[("create", "Event")] = KubeError(503, "unavailable", "POST /api/v1/namespaces/ns/events")

    async def scenario():
        poster = EventPoster(kube, clock)
        poster.emit(PoolBody().build(), "Normal", "Ready", "2 hosts ready")
        await poster.drain()

    with caplog.at_level(logging.WARNING, logger="tpusync_operator.events"):
        asyncio.run(scenario())
    assert events(kube) == []
    [line] = caplog.records
    assert "Ready" in line.getMessage() and "ns/pool" in line.getMessage() and "503" in line.getMessage()
    assert line.exc_info is None
