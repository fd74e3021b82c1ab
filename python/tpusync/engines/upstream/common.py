"""`tpu_raiden.api.common`: where a block is (upstream's BlockStatus, same values)."""

from __future__ import annotations

import enum


class BlockStatus(enum.Enum):
    INIT = 0
    REMOTE = 1
    HBM = 2
    HOST = 3
    HOST_AND_HBM = 4
