"""What the integration tiers share: a secret file, real tpusync-sidecar processes on 127.0.0.1,
and an engine's connection to a sidecar."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

import tpusync
from tpusync.local import sidecars as sidecar_mod
from tpusync.local.sidecars import write_secret

SECRET = b"integration-test-secret-0123456789"
BLOCK = 256 << 10


def engine(car) -> tpusync.KVStore:
    """An engine's store on `car`, over its control socket."""
    return tpusync.KVStore.connect(f"unix://{car.control_socket}")


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    write_secret(path, SECRET + b"\n")
    return str(path)


@pytest.fixture
def launch(tmp_path, secret_file):
    """launch(name, **kw) starts a sidecar with a control socket; all are stopped afterwards."""
    started: list[sidecar_mod.Sidecar] = []
    pools: list[str] = []

    def _launch(name: str, *, pool_path: str | None = None, dram_bytes: int = 64 << 20, block_bytes: int = BLOCK,
                **kw):
        pool = pool_path or f"/dev/shm/tpusync-it-{os.getpid()}-{name}-{uuid.uuid4().hex[:6]}"
        pools.append(pool)
        kw.setdefault("control_socket", str(tmp_path / f"{name}.sock"))
        s = sidecar_mod.launch(pool_path=pool, secret_file=secret_file, dram_bytes=dram_bytes,
                              block_bytes=block_bytes, **kw)
        s.pool_path = pool
        started.append(s)
        return s

    yield _launch
    for s in started:
        if s.process.poll() is None:
            s.kill()
    for p in pools:
        if os.path.exists(p):
            os.unlink(p)
        shutil.rmtree(p + ".weights", ignore_errors=True)  # where a sidecar keeps the weights it received
