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
                 stderr: int | IO[str] | None = None, extra_args: Sequence[str] = (),
                 python: str = sys.executable) -> ServerProcess:
    """Starts `python -m tpusync.serving` on 127.0.0.1 and returns once it is warmed up and listening.
    `extra_args`: more of its flags (`python -m tpusync.serving --help`); `python`: an interpreter
    with JAX (another environment's, beside an engine's that has none)."""
    args = [python, "-m", "tpusync.serving", "--role", role, "--port", "0",
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
    return ServerProcess(proc, read_ready(proc, role)["port"], role)


@dataclass
class SliceProcesses:
    """A multi-host slice of reference servers: the leader serves HTTP, the followers follow it."""

    leader: ServerProcess
    followers: list[subprocess.Popen[str]]

    @property
    def url(self) -> str:
        return self.leader.url

    def stop(self) -> None:
        """The leader tells the followers to exit as it stops; then they are waited for."""
        self.leader.stop()
        for f in self.followers:
            interrupt(f, grace=15)
            if f.stdout:
                f.stdout.close()


def start_slice(role: str, hosts: Sequence[tuple[str, str]], *, model_config: dict[str, Any], coordinator: str,
                cpu_devices: int = 0, stderr: int | IO[str] | None = None,
                extra_args: Sequence[str] = ()) -> SliceProcesses:
    """Starts one `python -m tpusync.serving` process per host of a slice (`hosts`: each host's
    sidecar control socket and data address) and returns once all are warmed up; the
    coordinator (host:port) is process 0's."""
    procs = []
    try:
        for i, (control_socket, data_address) in enumerate(hosts):
            args = [sys.executable, "-m", "tpusync.serving", "--role", role, "--port", "0",
                    "--model-config", json.dumps(model_config), "--control-socket", control_socket,
                    "--data-address", data_address, "--num-processes", str(len(hosts)), "--process-id", str(i),
                    "--coordinator", coordinator, "--cpu-devices", str(cpu_devices), *extra_args]
            procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True))
        ready = [read_ready(p, f"{role} process {i}") for i, p in enumerate(procs)]
    except BaseException:
        for p in procs:
            terminate(p, 5, signal.SIGKILL)
        raise
    return SliceProcesses(ServerProcess(procs[0], ready[0]["port"], role), procs[1:])


def read_ready(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    """The server's ready line: the first JSON object it prints (collective libraries such as
    gloo print their own lines to stdout first)."""
    assert proc.stdout is not None  # stdout=PIPE
    for line in proc.stdout:
        if line.startswith("{"):
            ready: dict[str, Any] = json.loads(line)
            return ready
    raise errors.UnavailableError(f"the {what} exited with {proc.wait()} before listening")
