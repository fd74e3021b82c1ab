"""Start reference model servers as processes (demo, tests, benchmarks)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from tpusync import errors
from tpusync.local.sidecars import terminate


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    port: int
    role: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        interrupt(self.process, grace=15)
        if self.process.stdout:
            self.process.stdout.close()


def interrupt(process: subprocess.Popen[Any], grace: float) -> None:
    """SIGINT (a server's clean shutdown), then SIGKILL if it has not exited within `grace` s."""
    terminate(process, grace, signal.SIGINT)


def start_server(role: str, *, model_config: dict[str, Any], control_socket: str | None = None,
                 data_address: str | None = None, peers: list[str] | None = None, prefix_cache: bool = True,
                 stderr: int | IO[str] | None = None, extra_args: Sequence[str] = ()) -> ServerProcess:
    """Starts `python -m tpusync.serving` on 127.0.0.1 and returns once it is warmed up and listening.
    `extra_args`: more of its flags (`python -m tpusync.serving --help`)."""
    args = [sys.executable, "-m", "tpusync.serving", "--role", role, "--port", "0",
            "--model-config", json.dumps(model_config)]
    if control_socket:
        args += ["--control-socket", control_socket]
    if data_address:
        args += ["--data-address", data_address]
    if peers:
        args += ["--peers", ",".join(peers)]
    if not prefix_cache:
        args.append("--no-prefix-cache")
    args += extra_args
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline()
    if not line:
        raise errors.UnavailableError(f"the {role} server exited with {proc.wait()} before listening")
    return ServerProcess(proc, json.loads(line)["port"], role)
