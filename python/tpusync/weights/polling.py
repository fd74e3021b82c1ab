"""Waiting on another process's progress (a commit, a peer's pull) by polling the pool."""

from __future__ import annotations

import time
from collections.abc import Callable


def backoff(first: float = 0.0005, cap: float = 0.02) -> Callable[[], None]:
    """A pause that sleeps `first` seconds, then twice as long each call, up to `cap`: quick
    when the other side is about to finish, cheap when it is slow."""
    delay = first

    def pause() -> None:
        nonlocal delay
        time.sleep(delay)
        delay = min(delay * 2, cap)
    return pause
