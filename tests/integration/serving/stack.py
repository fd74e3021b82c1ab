"""The sidecars and reference servers (or slices) that a serving module's tests share."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

from tpusync.local import sidecars as sidecar
from tpusync.local.sidecars import write_secret


class ServingStack:
    """Processes by name in `running`, the sidecars on one secret in `work`. close() stops them
    all, the last started first, and the sidecars a test relaunched under their name, then
    removes the sidecars' pools."""

    def __init__(self, work: Path, block_bytes: int) -> None:
        self.work = work
        self.block_bytes = block_bytes
        self.secret = work / "secret"
        write_secret(self.secret, uuid.uuid4().hex * 2)
        self.running: dict[str, Any] = {}
        self._started: list[Any] = []
        self._sidecars: list[str] = []
        self._pools: list[str] = []

    def add(self, name: str, process: Any) -> Any:
        """`process` (anything with stop()) under `name`, stopped by close()."""
        self.running[name] = process
        self._started.append(process)
        return process

    def sidecar(self, name: str, **kw: Any) -> sidecar.Sidecar:
        """A sidecar of 64 MiB DRAM, its control socket `name`.sock, its stderr discarded."""
        pool = f"/dev/shm/tpusync-{self.work.name}-{uuid.uuid4().hex[:8]}"
        self._pools.append(pool)
        self._sidecars.append(name)
        kw.setdefault("stderr", subprocess.DEVNULL)
        return self.add(name, sidecar.launch(pool_path=pool, secret_file=str(self.secret), dram_bytes=64 << 20,
                                             block_bytes=self.block_bytes,
                                             control_socket=str(self.work / f"{name}.sock"), **kw))

    def close(self) -> None:
        for s in reversed(self._started + [self.running.get(name) for name in self._sidecars]):
            if s is not None:
                s.stop()
        for pool in self._pools:
            for path in (pool, pool + ".lock"):
                if os.path.exists(path):
                    os.unlink(path)
