"""Sidecars of the engine tiers on pool files of their own in /dev/shm, and their cleanup.

    pool = pool_path("vllm", "s")      # /dev/shm/tpusync-vllm-<pid>-s-<random>
    ... sidecars.launch(pool_path=pool, ...)
    kill_and_remove(sidecars, [pool])  # a test module's teardown

    with lone_sidecar(work, "pause", b"secret...", dram_bytes=..., block_bytes=...) as host:
        ...                            # a trainer's or engine's host, dialing no peer
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tpusync.local import sidecars
from tpusync.local.sidecars import Sidecar, write_secret


def pool_path(tag: str, name: str = "") -> str:
    """A pool file that no other test process or run on this machine uses (pid, random suffix)."""
    middle = f"{name}-" if name else ""
    return f"/dev/shm/tpusync-{tag}-{os.getpid()}-{middle}{uuid.uuid4().hex[:6]}"


def remove_pools(pools: Iterable[str]) -> None:
    """Removes each pool file and the directory beside it where its sidecar keeps the weight
    versions it received (absent where none came)."""
    for pool in pools:
        if os.path.exists(pool):
            os.unlink(pool)
        shutil.rmtree(pool + ".weights", ignore_errors=True)


def kill_and_remove(running: Iterable[Sidecar], pools: Iterable[str]) -> None:
    """Kills the sidecars still running (a test may have killed some) and removes the pools:
    the pools go whether their sidecar was ever started or not."""
    for car in running:
        if car.process.poll() is None:
            car.kill()
    remove_pools(pools)


@contextmanager
def lone_sidecar(work: Path, tag: str, secret: bytes, *, dram_bytes: int, block_bytes: int,
                 control_socket: str = "control.sock", **launch: Any) -> Iterator[Sidecar]:
    """A sidecar that dials no peer (one host on its own, as a trainer's or an engine's is for
    weight versions), its secret file and control socket in `work`; afterwards stopped (drained)
    and its pool removed."""
    secret_file = write_secret(work / "secret", secret)
    pool = pool_path(tag)
    car = sidecars.launch(pool_path=pool, secret_file=secret_file, dram_bytes=dram_bytes, block_bytes=block_bytes,
                          control_socket=str(work / control_socket), peers=[], **launch)
    try:
        yield car
    finally:
        car.stop()
        remove_pools([pool])
