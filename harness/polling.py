"""Waiting for a condition: the one polling helper of the test tiers, e2e and bench.

Tests wait for what they need (a status written, a pod gone, bytes arrived), never for a
fixed time: `wait_for` polls a predicate until it holds, and fails with what it waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """The condition did not hold in time; the message names it and the last error."""


def wait_for(what: str, predicate: Callable[[], T], timeout: float, *, interval: float = 0.2,
             on_timeout: Callable[[], str] | None = None, step: Callable[[], object] | None = None,
             raise_on_timeout: bool = True) -> T:
    """Polls `predicate()` every `interval` seconds until it returns a truthy value, and
    returns that value. An exception from the predicate counts as "not yet" (reported if the
    deadline passes). Raises WaitTimeout naming `what`, with `on_timeout()` appended (logs).

    `step()` runs before each poll: something that makes the awaited change happen (e.g. a
    request that makes an engine publish what it found). With raise_on_timeout=False the
    predicate's last value is returned instead of raising (the caller asserts on it, with the
    state it wants to show), or its last exception re-raised."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        if step is not None:
            step()
        try:
            value = predicate()
            last_exc = None
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - reported on timeout
            last_exc = exc
        if time.monotonic() >= deadline:
            if not raise_on_timeout:
                if last_exc is not None:
                    raise last_exc
                return value
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            extra = on_timeout() if on_timeout else ""
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}{detail}{extra}")
        time.sleep(interval)  # pacing the polls; the condition, not the pause, ends the wait
