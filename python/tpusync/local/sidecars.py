"""Start and stop `tpusync-sidecar` processes (local demos, tests, benchmarks).

On Kubernetes the operator runs the sidecar; this module is for one machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tpusync import errors


def sidecar_binary() -> str:
    """The tpusync-sidecar installed with this package (on PATH of its environment)."""
    scripts = Path(sysconfig.get_path("scripts"))
    for candidate in (scripts / "tpusync-sidecar", Path(sys.executable).parent / "tpusync-sidecar"):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("tpusync-sidecar")
    if found is None:
        raise errors.NotFoundError("tpusync-sidecar is not installed next to this Python; reinstall the package")
    return found


def terminate(process: subprocess.Popen[Any], timeout: float = 30.0, sig: int = signal.SIGTERM) -> int:
    """`sig` (SIGTERM: a sidecar drains its connections and flushes write-behind; SIGINT: a
    server's clean shutdown), then SIGKILL after `timeout` s; returns the exit code."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@dataclass
class Sidecar:
    """A running sidecar process. Use as a context manager, or call stop()."""

    process: subprocess.Popen[str]
    data_port: int
    http_port: int
    control_socket: str | None
    args: list[str] = field(default_factory=list)
    pool_path: str = ""  # its shared-memory pool file

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.data_port}"

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for the drain; returns the exit code."""
        code = terminate(self.process, timeout)
        if self.process.stdout:
            self.process.stdout.close()
        return code

    def kill(self) -> None:
        """SIGKILL: no drain, no flush (what a crash looks like)."""
        self.process.kill()
        self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()

    def remove_pool(self) -> None:
        """Removes what the sidecar leaves in shared memory once stopped: its pool file and the
        weight versions' head files beside it (`<pool>.weights/`)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.pool_path)
        shutil.rmtree(self.pool_path + ".weights", ignore_errors=True)

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_secret(path: str | os.PathLike[str], secret: bytes | str) -> str:
    """Writes a pool secret file readable by its owner only (the sidecar refuses one that others
    can read); returns its path."""
    data = secret.encode() if isinstance(secret, str) else secret
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT
        f.write(data)
    return os.fspath(path)


def launch(*, pool_path: str, secret_file: str, dram_bytes: int, block_bytes: int,
           control_socket: str | None = None, disk_dir: str | None = None, disk_bytes: int = 0,
           shared_dir: str | None = None, shared_layout: str = "",
           data_port: int = 0, http_port: int = 0, streams: int = 4, peers: list[str] | None = None,
           extra: list[str] | None = None, stderr: int | IO[str] | None = None) -> Sidecar:
    """Starts a sidecar on 127.0.0.1 and waits until it listens (it prints one JSON line).

    `peers` are the pool's members, the only data ports it dials (`--peers`); by default every
    sidecar on this machine (127.0.0.1, any port), which is where launch() starts them.
    """
    args = [
        sidecar_binary(), "--bind=127.0.0.1", f"--data-port={data_port}", f"--http-port={http_port}",
        f"--pool-path={pool_path}", f"--dram-bytes={dram_bytes}", f"--block-bytes={block_bytes}",
        f"--auth-secret-file={secret_file}", f"--streams={streams}",
        f"--peers={','.join(['127.0.0.1'] if peers is None else peers)}",
    ]
    if control_socket:
        args.append(f"--control-socket={control_socket}")
    if disk_dir:  # created if missing, as the directory of a local run (a pod mounts its disk there)
        args += [f"--disk-dir={disk_dir}", f"--disk-bytes={disk_bytes}", "--create-disk-dir"]
    if shared_dir:
        args += [f"--shared-dir={shared_dir}", f"--shared-layout={shared_layout}"]
    args += extra or []
    return _start(args, control_socket, pool_path, stderr)


def relaunch(stopped: Sidecar, stderr: int | IO[str] | None = subprocess.DEVNULL) -> Sidecar:
    """Starts a stopped sidecar again as it was: its pool file (what it held survives), its
    control socket and its ports (its address is unchanged), as a restarted container is."""
    ports = {"--data-port": stopped.data_port, "--http-port": stopped.http_port}
    args = [f"{a.split('=', 1)[0]}={ports[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in ports else a
            for a in stopped.args]
    return _start(args, stopped.control_socket, stopped.pool_path, stderr)


def _start(args: list[str], control_socket: str | None, pool_path: str, stderr: int | IO[str] | None) -> Sidecar:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSYNC_")}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline()
    if not line:
        code = proc.wait()
        raise errors.UnavailableError(f"tpusync-sidecar exited with {code} before listening: {' '.join(args)}")
    ready = json.loads(line)
    return Sidecar(proc, ready["data_port"], ready["http_port"], control_socket, args, pool_path=pool_path)
