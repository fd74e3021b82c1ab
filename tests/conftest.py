"""Fixtures shared by every test tier."""

from __future__ import annotations

import os
import uuid

import pytest

# Tiers that run in an environment of their own, set up by their make target: where it is absent
# (a plain `pytest` in the main .venv) the tier collects nothing and says so at the end, instead
# of a green run that silently left it out.
NOT_COLLECTED: dict[str, str] = {}


def not_collected(tier: str, why: str) -> list[str]:
    """For a tier's conftest without its environment: records why, returns its collect_ignore_glob."""
    NOT_COLLECTED[tier] = why
    return ["*"]


def pytest_terminal_summary(terminalreporter) -> None:
    for tier, why in sorted(NOT_COLLECTED.items()):
        terminalreporter.write_line(f"NOT RUN {tier}: {why}", yellow=True, bold=True)


@pytest.fixture
def shm_path():
    """A fresh /dev/shm path for a pool file, removed afterwards."""
    path = f"/dev/shm/tpusync-pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    if os.path.exists(path):
        os.unlink(path)
