"""Triggered passes are coalesced per object: events that arrive while a pass runs yield
exactly one more pass; a pass that must come back touches its object after the delay (the
touch's watch event triggers the retry on the active replica), unless a pass came first."""

from __future__ import annotations

import asyncio

import kopf

from tpusync_operator.passes import PassQueue, owner_key, set_owner_key


class Calls(list):
    """A list of calls that a test can wait on: `await calls.reach(n)` returns once n calls are
    recorded (the retries run on timers; waiting on the calls themselves, not on a sleep)."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = asyncio.Event()

    def append(self, item: object) -> None:
        super().append(item)
        self._changed.set()

    async def reach(self, n: int, seconds: float = 5.0) -> None:
        async def wait() -> None:
            while len(self) < n:
                self._changed.clear()
                await self._changed.wait()
        await asyncio.wait_for(wait(), seconds)


def test_events_during_a_pass_yield_one_more_pass():
    async def main():
        started, release = asyncio.Event(), asyncio.Event()
        runs: list[str] = []

        async def run(key):
            runs.append(key)
            started.set()
            await release.wait()

        q = PassQueue(run, touch=None)
        q.request("a")
        await started.wait()
        for _ in range(5):          # a burst while "a" runs
            q.request("a")
        q.request("b")
        release.set()
        await q.drain()
        return runs

    assert sorted(asyncio.run(main())) == ["a", "a", "b"]


def test_failing_passes_touch_their_object_after_the_delay_and_do_not_stop_the_queue():
    async def main():
        runs: list[str] = []
        touched = Calls()  # (key, seconds after start)

        async def run(key):
            runs.append(key)
            if key == "tmp":
                raise kopf.TemporaryError("later", delay=0.01)
            if key == "boom":
                raise RuntimeError("boom")
            if key == "bad":
                raise kopf.PermanentError("invalid spec")

        async def touch(key):
            touched.append((key, round(asyncio.get_running_loop().time() - t0, 2)))

        q = PassQueue(run, touch, error_delay=0.02)
        t0 = asyncio.get_running_loop().time()
        for key in ("tmp", "boom", "bad", "ok"):
            q.request(key)
        await q.drain()
        await touched.reach(2)
        q.request("ok")
        await q.settle()
        return runs, touched, q.retrying()

    runs, touched, pending = asyncio.run(main())
    assert sorted(runs) == ["bad", "boom", "ok", "ok", "tmp"]
    assert [k for k, _ in touched] == ["tmp", "boom"]                 # not "bad", not "ok"
    assert touched[0][1] >= 0.01 and touched[1][1] >= 0.02
    assert pending == set()


class FailingPass:
    """A pass that asks to be retried after `delay` until `fixed` is set."""

    def __init__(self, delay: float) -> None:
        self.delay, self.fixed = delay, False

    async def __call__(self, key: object) -> None:
        if not self.fixed:
            raise kopf.TemporaryError("later", delay=self.delay)


async def pass_once_fixed(q: PassQueue, run: FailingPass, key: object) -> set[object]:
    """Fixes the pass and runs it for `key`: returns what still waits for a retry right after it
    (nothing, where the pass cancelled the retry)."""
    run.fixed = True
    q.request(key)
    await q.drain()
    return q.retrying()


def test_a_pass_before_the_delay_cancels_the_retry():
    async def main():
        touched: list[str] = []
        run = FailingPass(delay=3600)

        async def touch(key):
            touched.append(key)

        q = PassQueue(run, touch)
        q.request("a")
        await q.drain()
        assert q.retrying() == {"a"}
        # e.g. the CRD it waited for was installed: this pass succeeds and cancels the retry
        pending = await pass_once_fixed(q, run, "a")
        await q.settle()        # no touch can come any more
        return touched, pending

    assert asyncio.run(main()) == ([], set())


def test_owner_key_takes_only_our_controller_reference():
    ref = {"apiVersion": "tpusync.dev/v1alpha1", "kind": "TPUSyncPool", "name": "p", "controller": True}
    kinds = ("TPUSyncPool", "DisaggregatedServing")
    assert owner_key({"namespace": "n", "ownerReferences": [ref]}, "tpusync.dev", kinds) == ("TPUSyncPool", "n", "p")
    not_controller = {"namespace": "n", "ownerReferences": [{**ref, "controller": False}]}
    assert owner_key(not_controller, "tpusync.dev", kinds) is None
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

        q = PassQueue(run, touch=None, limit=2)
        for key in range(5):      # all five tasks are ready before the test resumes
            q.request(key)
        await two.wait()
        release.set()
        await q.drain()
        return peak

    assert asyncio.run(main()) == 2


def waits_logged(records) -> list[str]:
    """The waits the queue announced after each failed touch ("... trying again in W s")."""
    return [r.getMessage().partition("trying again in ")[2] for r in records
            if "touching it failed" in r.getMessage()]


async def failing_touches(failures: int, *, retry_delay: float, error_delay: float,
                          touch_backoff: float) -> tuple[Calls, PassQueue]:
    """A pass that always asks to be retried after `retry_delay`, and a touch (which carries the
    retry) that fails `failures` times: returns once the touch has been tried once more."""
    attempts = Calls()

    async def run(key):
        raise kopf.TemporaryError("later", delay=retry_delay)

    async def touch(key):
        attempts.append(len(attempts) + 1)
        if len(attempts) <= failures:
            raise RuntimeError(f"API 500 #{len(attempts)}")

    q = PassQueue(run, touch, error_delay=error_delay)
    q.touch_backoff = touch_backoff
    q.request("a")
    await q.drain()
    await attempts.reach(failures + 1)
    return attempts, q


def test_a_failed_touch_is_tried_again_with_backoff_until_it_is_written(caplog):
    """Issue 14, item 14: the touch that carries a retry fails too (the API server that
    failed the pass is often still failing). It must not be dropped: it is tried again, the
    waits doubling, and logged each time, until it is written."""
    async def main():
        attempts, q = await failing_touches(3, retry_delay=0.01, error_delay=1.0, touch_backoff=0.02)
        await q.settle()                    # the retry that wrote it finishes, and none follows
        return list(attempts), q.retrying()

    with caplog.at_level("WARNING", logger="tpusync_operator.passes"):
        attempts, pending = asyncio.run(main())
    assert attempts == [1, 2, 3, 4] and pending == set()
    assert waits_logged(caplog.records) == ["0.02 s", "0.04 s", "0.08 s"]
    assert "API 500 #1" in caplog.records[0].getMessage()


def test_the_touch_backoff_is_capped_by_the_error_delay(caplog):
    with caplog.at_level("WARNING", logger="tpusync_operator.passes"):
        asyncio.run(failing_touches(5, retry_delay=0, error_delay=0.03, touch_backoff=0.01))
    assert waits_logged(caplog.records) == ["0.01 s", "0.02 s", "0.03 s", "0.03 s", "0.03 s"]


def test_a_pass_ends_a_failing_touch_retry():
    """While the touch keeps failing, a pass of the object (any other event) makes it moot."""
    async def main():
        attempts = Calls()
        run = FailingPass(delay=0)

        async def touch(key):
            attempts.append(key)
            raise RuntimeError("down")

        q = PassQueue(run, touch)
        q.touch_backoff = 0.01
        q.request("a")
        await q.drain()
        await attempts.reach(2)
        pending = await pass_once_fixed(q, run, "a")
        seen = len(attempts)   # the touches tried until the pass cancelled the retry (nothing awaited since)
        await q.settle()
        return seen, len(attempts), pending

    seen, later, pending = asyncio.run(main())
    assert seen >= 2 and later == seen and pending == set()


def test_a_disaggregated_sets_workload_leads_to_its_serving():
    """A Lockstep serving's LeaderWorkerSets are the DisaggregatedSet controller's: their changes
    reach the serving through the set it owns, named like it and labelled with it."""
    ref = {"apiVersion": "disaggregatedset.x-k8s.io/v1", "kind": "DisaggregatedSet", "name": "s", "controller": True}
    meta = {"namespace": "n", "labels": {"tpusync.dev/serving": "s"}, "ownerReferences": [ref]}
    key = set_owner_key(meta, "disaggregatedset.x-k8s.io", "tpusync.dev/serving")
    assert key == ("DisaggregatedServing", "n", "s")
    for other in ({**meta, "labels": {"tpusync.dev/serving": "t"}},                  # another serving's label
                  {**meta, "ownerReferences": [{**ref, "controller": False}]},
                  {**meta, "ownerReferences": [{**ref, "apiVersion": "apps/v1", "kind": "Deployment"}]}):
        assert set_owner_key(other, "disaggregatedset.x-k8s.io", "tpusync.dev/serving") is None
