"""Triggered passes are coalesced per object: events that arrive while a pass runs yield
exactly one more pass, and a failing pass neither stops the queue nor is retried by it."""

from __future__ import annotations

import asyncio

import kopf

from tpusync_operator.passes import PassQueue, owner_key


def test_events_during_a_pass_yield_one_more_pass():
    async def main():
        started, release = asyncio.Event(), asyncio.Event()
        runs: list[str] = []

        async def run(key):
            runs.append(key)
            started.set()
            await release.wait()

        q = PassQueue(run)
        q.request("a")
        await started.wait()
        for _ in range(5):          # a burst while "a" runs
            q.request("a")
        q.request("b")
        release.set()
        await q.drain()
        return runs

    assert sorted(asyncio.run(main())) == ["a", "a", "b"]


def test_a_failing_pass_is_not_retried_and_does_not_stop_the_queue():
    async def main():
        runs: list[str] = []

        async def run(key):
            runs.append(key)
            if key == "tmp":
                raise kopf.TemporaryError("later", delay=1)
            if key == "boom":
                raise RuntimeError("boom")

        q = PassQueue(run)
        for key in ("tmp", "boom", "ok"):
            q.request(key)
        await q.drain()
        q.request("ok")
        await q.drain()
        return runs

    assert sorted(asyncio.run(main())) == ["boom", "ok", "ok", "tmp"]


def test_owner_key_takes_only_our_controller_reference():
    ref = {"apiVersion": "tpusync.dev/v1alpha1", "kind": "TPUSyncPool", "name": "p", "controller": True}
    kinds = ("TPUSyncPool", "DisaggregatedServing")
    assert owner_key({"namespace": "n", "ownerReferences": [ref]}, "tpusync.dev", kinds) == ("TPUSyncPool", "n", "p")
    assert owner_key({"namespace": "n", "ownerReferences": [{**ref, "controller": False}]}, "tpusync.dev", kinds) is None
    assert owner_key({"namespace": "n", "ownerReferences": [{**ref, "apiVersion": "x.dev/v1"}]},
                     "tpusync.dev", kinds) is None
    assert owner_key({"namespace": "n"}, "tpusync.dev", kinds) is None


def test_at_most_limit_passes_run_at_once():
    async def main():
        running, peak, two, release = 0, 0, asyncio.Event(), asyncio.Event()

        async def run(key):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            if running == 2:
                two.set()
            await release.wait()
            running -= 1

        q = PassQueue(run, limit=2)
        for key in range(5):      # all five tasks are ready before the test resumes
            q.request(key)
        await two.wait()
        release.set()
        await q.drain()
        return peak

    assert asyncio.run(main()) == 2
