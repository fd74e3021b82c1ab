"""The shared tier's pool fixture: every test runs on a local directory and on sshfs (FUSE)."""

from __future__ import annotations

import pytest

from tests.integration.shared.pool import Pool


@pytest.fixture(params=["local", "sshfs"])
def make_pool(request, tmp_path):
    pools: list[Pool] = []

    def _make(n: int = 2, size: str | None = None) -> Pool:
        p = Pool(tmp_path, request.param, n, size)
        pools.append(p)
        return p

    yield _make
    for p in pools:
        p.close()
