"""Simulated hosts on a shaped fabric (harness/fabric.py), each with its own sidecar."""

from __future__ import annotations

import pytest

from harness import fabric as fab
from tests.integration.conftest import BLOCK


@pytest.fixture
def make_fabric():
    """make_fabric(n, profile) builds n hosts; every fabric is torn down afterwards."""
    made: list[fab.Fabric] = []

    def _make(n: int, profile: fab.Profile = fab.DC) -> fab.Fabric:
        f = fab.Fabric(n, profile)
        made.append(f)
        f.start()
        return f

    yield _make
    for f in made:
        f.close()


@pytest.fixture
def sidecars(make_fabric, secret_file):
    """sidecars(n, profile, streams=4 or one per host, dram_bytes=...) -> (fabric, one sidecar per host)."""

    def _start(n: int, profile: fab.Profile = fab.DC, *, streams: int | list[int] = 4, dram_bytes: int = 96 << 20):
        f = make_fabric(n, profile)
        per_host = streams if isinstance(streams, list) else [streams] * n
        return f, [h.sidecar(secret_file=secret_file, dram_bytes=dram_bytes, block_bytes=BLOCK, streams=s)
                   for h, s in zip(f.hosts, per_host)]

    return _start
