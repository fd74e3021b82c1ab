"""`python -m tpusync.weights receive` as the weights and fabric tiers start it on a destination
host, and the line it ends with."""

from __future__ import annotations

import subprocess
import sys


def receive_command(car, *args: str, version: int = 1, stall: float = 30.0) -> list[str]:
    """The receiver of model "m" on the host of sidecar `car`; `args`: its sources, destinations..."""
    return [sys.executable, "-m", "tpusync.weights", "receive", f"--control-socket={car.control_socket}",
            f"--host={car.address}", "--model=m", f"--version={version}", f"--stall-seconds={stall}",
            "--timeout-seconds=60", *args]


def committed(p: subprocess.Popen, version: int = 1) -> str:
    """The receiver's final line (it prints one line per chunk before it): `version` committed."""
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"committed version {version}"), out
    return last
