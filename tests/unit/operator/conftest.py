"""Fixtures for the operator unit tests (helpers live in op_helpers.py)."""

from __future__ import annotations

import pytest
from op_helpers import Clock, FakeKube

from harness.gke_api import FakeGKEState, serve


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


@pytest.fixture
def gke_server() -> tuple[FakeGKEState, str]:
    """The documented GKE REST API on 127.0.0.1 (harness/gke_api.py): (state, base URL)."""
    state, url, stop = serve()
    yield state, url
    stop()
