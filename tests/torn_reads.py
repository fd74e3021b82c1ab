"""A reader thread that watches a sampler's weights while versions swap underneath it.

Each version the test publishes fills every leaf with its number, so a read whose leaves'
first and last elements are not all that number is torn."""

from __future__ import annotations

import threading

from tpusync.weights import VersionedWeights


class TornReadWatcher:
    """Reads `sampler.current()` over and over, from `with` to its end; `torn` holds every torn
    read as (version, values seen), `seen` every version read."""

    def __init__(self, sampler: VersionedWeights) -> None:
        self.sampler = sampler
        self.torn: list[tuple[int, set[float]]] = []
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read)

    def _read(self) -> None:
        while not self._stop.is_set():
            v, p = self.sampler.current()
            if p is None:
                continue
            values = {float(leaf[0]) for leaf in p.values()} | {float(leaf[-1]) for leaf in p.values()}
            if values != {float(v)}:
                self.torn.append((v, values))
            with self._cond:
                self.seen.add(v)
                self._cond.notify_all()

    def saw(self, version: int, timeout: float = 30) -> bool:
        """Whether the reader read `version` (or a torn read) within `timeout`: the test waits
        for this before the next swap."""
        with self._cond:
            return self._cond.wait_for(lambda: version in self.seen or self.torn, timeout=timeout)

    def __enter__(self) -> TornReadWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
