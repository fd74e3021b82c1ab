"""What the sidecar tests share: blocks of known content, checks of what a store holds and of
the sidecar's /metrics."""

from __future__ import annotations

import re
import urllib.request

import numpy as np

import tpusync
from tests.integration.conftest import BLOCK


def blocks(first: int, n: int, size: int = BLOCK) -> dict[int, np.ndarray]:
    return {k: np.random.default_rng(k).integers(0, 256, size, dtype=np.uint8) for k in range(first, first + n)}


def assert_holds(store: tpusync.KVStore, data: dict[int, np.ndarray]) -> None:
    """Every block is found, read into a buffer of its own length, byte for byte."""
    out = [np.zeros(v.size, np.uint8) for v in data.values()]
    assert store.get(list(data), out) == [True] * len(data)
    for (k, want), got in zip(data.items(), out):
        assert np.array_equal(got, want), f"block {k} differs"


def metric(s, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{s.http_port}/metrics", timeout=5).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)$"
    m = re.search(pattern, text, re.M)
    assert m, f"{name} {labels} not in /metrics"
    return float(m.group(1))
