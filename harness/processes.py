"""Child processes of the tests: each logged to a file, in a process group of its own, and
killed when the process that started it dies; plus free ports on the loopback address."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"


class ProcessExited(RuntimeError):
    """A component exited while it was expected to run."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, below the kernel's ephemeral range: a port the
    kernel hands out can be reused for any outgoing connection before the caller binds it
    (and was: a coordinator failed to bind one), this one only by another explicit bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000..{low - 1} on {LOOPBACK}")


@dataclass
class Component:
    """One long-running child process (a control-plane binary, the operator, a controller)."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent)  # noqa: PLW1509 - prctl only, no locks

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-n:])

    def check(self) -> None:
        """Raises ProcessExited (with the log's tail) if the process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ProcessExited(f"{self.name} exited with code {self.proc.returncode}; "
                                f"last lines of {self.log}:\n{self.tail()}")

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the process group, then SIGKILL after `grace` seconds."""
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace)
        # The group may hold children even after the leader exited.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=grace)

    # ----- resource usage (bench) ---------------------------------------------------------
    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the process so far (/proc/<pid>/stat)."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks

    def peak_rss_bytes(self) -> int:
        """Peak resident set size (VmHWM) of the process."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the process that started it dies, so a killed
    test run (CI timeout, kill -9) leaks no processes. Linux only."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
