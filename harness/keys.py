"""Block keys for the integration tests: (hi, lo) rows of a (n, 2) uint64 array."""

from __future__ import annotations

import numpy as np


def keys_for(tag: int, n: int) -> np.ndarray:
    """n block keys: hi the test's tag, lo the block's index."""
    k = np.empty((n, 2), np.uint64)
    k[:, 0] = tag
    k[:, 1] = np.arange(n, dtype=np.uint64)
    return k
