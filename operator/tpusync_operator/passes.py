"""Reconcile passes triggered by watch events of other objects (children, pool pods, nodes,
the referenced pool, optional CRDs), coalesced per object.

A burst of events for one object yields at most one running pass plus one queued behind
it, which sees every change of the burst. Every pass starts from a watch event, so a
replica that kopf's peering has paused (no events) starts none.

A pass that asks to come back (`kopf.TemporaryError`, e.g. a CRD the API server does not
serve yet) or fails is retried the way kopf retries its own handlers: after the delay the
queue `touch`es the object (a write that yields a watch event), and whichever replica is
active then runs the pass. Any pass of the object in the meantime cancels the retry. A touch
that fails (the API server is what failed the pass, often) is tried again, with a backoff
from `touch_backoff` doubling up to `error_delay`, until it is written or a pass makes it
moot: a retry is never dropped."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import kopf

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)  # the key of one object


@dataclass
class _Slot:
    task: asyncio.Task[None]
    again: bool = False


@dataclass
class PassQueue(Generic[K]):
    """`run(key)` performs one pass for the object `key` (a no-op when it is gone). At most
    `limit` triggered passes run at once: a burst (a rollout of many objects) then queues
    here instead of crowding the API server, and passes of new objects (their own create
    handlers, outside this queue) are not starved."""
    run: Callable[[K], Awaitable[None]]
    touch: Callable[[K], Awaitable[None]]
    limit: int = 8
    error_delay: float = 60.0       # kopf's default backoff after an unexpected error
    touch_backoff: float = 1.0      # first wait after a failed touch
    _slots: dict[K, _Slot] = field(default_factory=dict)
    _running: asyncio.Semaphore | None = None
    _retries: dict[K, asyncio.Task[None]] = field(default_factory=dict)

    def request(self, key: K) -> None:
        slot = self._slots.get(key)
        if slot is not None:
            slot.again = True
        else:
            self._slots[key] = _Slot(asyncio.create_task(self._loop(key), name=f"reconcile {key}"))

    async def _loop(self, key: K) -> None:
        if self._running is None:
            self._running = asyncio.Semaphore(self.limit)
        try:
            while True:
                async with self._running:
                    self._slots[key].again = False   # what arrived while queued, this pass sees
                    self._cancel_retry(key)
                    try:
                        await self.run(key)
                    except kopf.PermanentError as e:
                        log.debug("triggered pass of %s: %s", key, e)     # already in its status
                    except kopf.TemporaryError as e:
                        log.debug("triggered pass of %s: %s", key, e)
                        self._retry_later(key, e.delay if e.delay is not None else self.error_delay)
                    except Exception:
                        log.exception("triggered pass of %s failed", key)
                        self._retry_later(key, self.error_delay)
                if not self._slots[key].again:
                    return
        finally:
            del self._slots[key]

    def _retry_later(self, key: K, delay: float) -> None:
        async def later() -> None:
            wait, backoff = delay, self.touch_backoff
            while True:
                await asyncio.sleep(wait)
                try:
                    await self.touch(key)
                    break
                except Exception as e:  # noqa: BLE001 - any failure: the touch is tried again
                    log.warning("retrying %s: touching it failed (%s); trying again in %g s", key, e, backoff)
                wait, backoff = backoff, min(backoff * 2, max(self.error_delay, self.touch_backoff))
            # Still registered unless a pass (perhaps the touch's own) cancelled it meanwhile.
            if self._retries.get(key) is asyncio.current_task():
                del self._retries[key]
        self._cancel_retry(key)
        self._retries[key] = asyncio.create_task(later(), name=f"retry {key}")

    def _cancel_retry(self, key: K) -> None:
        task = self._retries.pop(key, None)
        if task is not None:
            task.cancel()

    async def drain(self) -> None:
        """Wait until no pass is running or queued (tests, shutdown)."""
        while tasks := [s.task for s in self._slots.values()]:
            await asyncio.gather(*tasks, return_exceptions=True)

    def retrying(self) -> set[K]:
        """The keys whose object will be touched after a delay: while this is empty and no pass
        runs, the queue does nothing until the next request."""
        return set(self._retries)

    async def settle(self) -> None:
        """Wait until no pass runs or is queued and no retry is pending (each has touched its
        object or been cancelled): from then on the queue is idle until the next request."""
        await self.drain()
        while self._retries:
            await asyncio.gather(*self._retries.values(), return_exceptions=True)
            await self.drain()

    def close(self) -> None:
        for task in [s.task for s in self._slots.values()] + list(self._retries.values()):
            task.cancel()


def owner_key(meta: dict[str, Any], group: str, kinds: tuple[str, ...]) -> tuple[str, str, str] | None:
    """(kind, namespace, name) of the controlling owner of a child, if it is one of ours."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") in kinds and \
                str(ref.get("apiVersion", "")).startswith(group + "/"):
            return ref["kind"], meta.get("namespace", ""), ref["name"]
    return None


def set_owner_key(meta: dict[str, Any], set_api_group: str, serving_label: str) -> tuple[str, str, str] | None:
    """The serving behind a LeaderWorkerSet of its DisaggregatedSet: that controller owns the
    set's LeaderWorkerSets, and the serving's label on them names the same serving."""
    serving = (meta.get("labels") or {}).get(serving_label)
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == "DisaggregatedSet" and ref.get("name") == serving and \
                str(ref.get("apiVersion", "")).startswith(set_api_group + "/"):
            return "DisaggregatedServing", meta.get("namespace", ""), serving
    return None
