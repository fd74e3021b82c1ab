"""Fixtures shared by every test tier."""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture
def shm_path():
    """A fresh /dev/shm path for a pool file, removed afterwards."""
    path = f"/dev/shm/tpusync-pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    if os.path.exists(path):
        os.unlink(path)
