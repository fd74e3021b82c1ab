"""Fixtures for the operator unit tests (helpers live in op_helpers.py)."""

from __future__ import annotations

import pytest

from op_helpers import Clock, FakeKube


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()
