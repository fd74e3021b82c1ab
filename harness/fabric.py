"""A data-center fabric on one machine: N simulated hosts as Linux network namespaces.

Each host is a network namespace with one NIC (`eth0`, a veth pair) plugged into a bridge
that lives in a switch namespace of its own; nothing is created in the root namespace, and
the addresses (10.231.0.1, 10.231.0.2, ...) exist only inside these namespaces, which have
no route anywhere else. Each NIC is shaped like a real one, so the link and not the two
cores is the bottleneck:

- rate, both directions: an HTB class on the host's egress (upload; a NIC-like 1000-packet
  queue behind it) and on the switch port's egress (download; a shallow byte FIFO behind
  it, `buffer_ms` of line rate, as a switch buffer);
- one-way delay and random loss on the host's egress: this kernel has no netem, so an
  iptables NFQUEUE rule hands every outgoing packet's metadata to `fabric-delay`
  (fabric_delay.c, built here), which gives the verdict `delay_us` later (RTT between two
  hosts = 2 x delay_us) and drops `loss_percent` of them;
- optionally the TCP socket-buffer ceiling (net.ipv4.tcp_rmem/tcp_wmem, per namespace),
  scaled down with the rate, so one stream's window can be what limits it.

Processes run inside a host with `Host.popen` (`ip netns exec`); `Host.sidecar` starts a
tpusync-sidecar bound to the host's address. Engines reach their sidecar through its UNIX
control socket, which works from any namespace. `Host.counters` reads the NIC's byte
counters, so callers can check that traffic really crossed the shaped links.

Names derive from the creating process (`tsf-<pid>-<random>-...`); a Fabric removes its
namespaces (and with them every link, qdisc and rule) on close, and every new Fabric first
removes the namespaces of creators that are no longer alive, killing what still runs there.

Needs root, iproute2 (`ip`, `tc`), iptables and a C compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

PREFIX = "tsf-"
SUBNET = "10.231.0"
DATA_PORT, HTTP_PORT = 9400, 9401
REPO = Path(__file__).resolve().parents[1]
DELAY_SOURCE = Path(__file__).with_name("fabric_delay.c")
NETNS_DIR = Path("/run/netns")
WORK_ROOT = "/tmp"  # each fabric's control sockets: /tmp/<fabric name>/
T = TypeVar("T")


class FabricUnavailable(RuntimeError):
    """This machine cannot build the fabric (not root, or a tool is missing)."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """How every host's NIC behaves. RTT between two hosts = 2 x delay_us (+ serialisation)."""

    name: str
    rate_mbit: int                  # per host, each direction
    delay_us: float                 # one-way, on each host's egress
    loss_percent: float = 0.0       # of the packets each host sends (GSO packets: all or nothing, like netem)
    window_bytes: int | None = None  # tcp_rmem / tcp_wmem ceiling in every host; None: the kernel's
    buffer_ms: float = 2.0          # switch port buffer towards each host, in milliseconds of line rate

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    @property
    def rtt_us(self) -> float:
        return 2 * self.delay_us

    def replace(self, **kw) -> Profile:
        return dataclasses.replace(self, **kw)


# A data-center fabric scaled to two cores: 1 Gbit/s per host (100-200 Gbit/s NICs scaled
# down ~100x), 100 us RTT.
DC = Profile("dc", rate_mbit=1000, delay_us=50)
# An oversubscribed fabric: less bandwidth per host, queueing delay, some loss.
CONGESTED = Profile("congested", rate_mbit=400, delay_us=250, loss_percent=0.1)
# A long path (another zone) with socket buffers scaled down like the rate: one TCP stream
# is window-limited (its window / RTT is below the line rate), several streams are not.
CROSS_ZONE = Profile("cross-zone", rate_mbit=1000, delay_us=1000, window_bytes=128 << 10)
PROFILES = {p.name: p for p in (DC, CONGESTED, CROSS_ZONE)}


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def preflight() -> None:
    """Raises FabricUnavailable naming what this machine lacks."""
    missing = [t for t in ("ip", "tc", "iptables", "cc") if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.insert(0, "root")
    if missing:
        raise FabricUnavailable(f"the fabric needs {', '.join(missing)} (make system-deps installs the packages)")


def delay_binary() -> str:
    """fabric-delay, compiled from fabric_delay.c into build/fabric/ once per source version."""
    digest = hashlib.sha256(DELAY_SOURCE.read_bytes()).hexdigest()[:12]
    out = REPO / "build" / "fabric" / f"fabric-delay-{digest}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        _run("cc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(tmp), str(DELAY_SOURCE))
        tmp.rename(out)  # atomic: a concurrent build of the same source is harmless
    return str(out)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace(ns: str) -> None:
    """Kills every process in the namespace, then deletes it (its links, qdiscs and rules go with it)."""
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    _run("ip", "netns", "delete", ns, check=False)


def _stale(name: str) -> bool:
    """A fabric name whose creating process is gone."""
    try:
        pid = int(name[len(PREFIX):].split("-", 1)[0])
    except ValueError:
        return True
    return not alive(pid)


def cleanup_stale() -> list[str]:
    """Removes the namespaces and work directories of fabrics whose creating process is gone;
    returns the namespaces' names."""
    removed = []
    for entry in NETNS_DIR.iterdir() if NETNS_DIR.is_dir() else ():
        if entry.name.startswith(PREFIX) and _stale(entry.name):
            kill_namespace(entry.name)
            removed.append(entry.name)
    for entry in Path(WORK_ROOT).glob(f"{PREFIX}*"):
        if _stale(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
    return removed


_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNET = 0x40000000


def in_namespace(ns: str, fn: Callable[[], T]) -> T:
    """Runs fn in a thread that has joined the network namespace `ns` (sockets it opens are
    inside the fabric); the thread ends with it, so this process's other threads stay out."""
    box: dict = {}

    def run() -> None:
        try:
            fd = os.open(NETNS_DIR / ns, os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {ns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=f"netns-{ns}")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclasses.dataclass
class Counters:
    tx_bytes: int
    rx_bytes: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes)


@dataclasses.dataclass
class FabricSidecar:
    """A tpusync-sidecar running inside a host, reachable at `address` from the other hosts."""

    host: Host
    process: subprocess.Popen
    data_port: int
    http_port: int
    control_socket: str
    pool_path: str
    args: list[str]

    @property
    def address(self) -> str:
        return f"{self.host.ip}:{self.data_port}"

    def metrics(self) -> str:
        """Its Prometheus /metrics page, fetched from inside its host."""
        import urllib.request

        url = f"http://{self.host.ip}:{self.http_port}/metrics"
        return in_namespace(self.host.ns, lambda: urllib.request.urlopen(url, timeout=10).read().decode())

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for the drain; returns the exit code."""
        from tpusync.local.sidecars import terminate

        code = terminate(self.process, timeout)
        self._close()
        return code

    def kill(self) -> None:
        """SIGKILL: what a crash looks like."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._close()

    def _close(self) -> None:
        if self.process.stdout:
            self.process.stdout.close()
        for path in (self.pool_path,):
            if os.path.exists(path):
                os.unlink(path)
        shutil.rmtree(self.pool_path + ".weights", ignore_errors=True)


class Host:
    """One simulated host: a network namespace with one shaped NIC (eth0) at `ip`."""

    def __init__(self, fabric: Fabric, index: int):
        self.fabric = fabric
        self.index = index
        self.name = f"h{index}"
        self.ns = f"{fabric.name}-h{index}"
        self.ip = f"{SUBNET}.{index + 1}"
        self.port = f"p{index}"  # its port on the switch
        self._delay: subprocess.Popen | None = None
        self._delay_lock = threading.Lock()
        self._down = False
        self.sidecars: list[FabricSidecar] = []

    def __repr__(self) -> str:
        return f"Host({self.name} {self.ip})"

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Starts a process inside this host (its network namespace); the harness kills it on close."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], **kw)
        self.fabric._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", self.ns, *argv, check=check)

    def sidecar(self, *, secret_file: str, dram_bytes: int, block_bytes: int, streams: int = 4,
                data_port: int = DATA_PORT, http_port: int = HTTP_PORT, extra: Sequence[str] = (),
                stderr=subprocess.DEVNULL, prelude: str | None = None) -> FabricSidecar:
        """Starts a tpusync-sidecar bound to this host's address; waits until it listens.

        `prelude`, a shell command, runs first in the sidecar's own mount namespace (each
        `ip netns exec` has one): a FUSE mount made there is seen by that sidecar alone."""
        from tpusync.local.sidecars import sidecar_binary

        tag = f"{self.ns}-{data_port}-{uuid.uuid4().hex[:6]}"
        pool = f"/dev/shm/{tag}"
        sock = os.path.join(self.fabric.workdir, f"{self.name}-{data_port}.sock")
        args = [sidecar_binary(), f"--bind={self.ip}", f"--data-port={data_port}", f"--http-port={http_port}",
                f"--pool-path={pool}", f"--dram-bytes={dram_bytes}", f"--block-bytes={block_bytes}",
                f"--auth-secret-file={secret_file}", f"--streams={streams}", f"--control-socket={sock}",
                f"--peers={','.join(h.ip for h in self.fabric.hosts)}", *extra]  # the pool: every host
        env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSYNC_")}
        argv = args if prelude is None else ["sh", "-c", f"{prelude} && exec {shlex.join(args)}"]
        proc = self.popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tpusync-sidecar exited with {proc.wait()} before listening in {self.ns}: {args}")
        ready = json.loads(line)
        car = FabricSidecar(self, proc, ready["data_port"], ready["http_port"], sock, pool, args)
        self.sidecars.append(car)
        return car

    def counters(self) -> Counters:
        """Bytes sent and received by this host's NIC (the shaped link)."""
        out = json.loads(_run("ip", "-n", self.ns, "-s", "-j", "link", "show", "dev", "eth0").stdout)[0]["stats64"]
        return Counters(out["tx"]["bytes"], out["rx"]["bytes"])

    def delay_stats(self) -> tuple[int, int, int]:
        """(packets seen, dropped, accepted) by this host's delay line."""
        fields = self._command("stats").split()
        return int(fields[1]), int(fields[2]), int(fields[3])

    def set_loss(self, percent: float) -> None:
        """Random loss on this host's egress, in percent of its packets."""
        self._command(f"loss {percent}")

    def set_delay(self, delay_us: float) -> None:
        self._command(f"delay {delay_us}")

    def link_down(self) -> None:
        """Every packet into or out of this host's NIC is dropped until link_up()."""
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            self.run(["iptables", "-w", "-I", chain, "1", flag, "eth0", "-j", "DROP"])
        self._down = True

    def link_up(self) -> None:
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            self.run(["iptables", "-w", "-D", chain, flag, "eth0", "-j", "DROP"])
        self._down = False

    def dropped_packets(self) -> int:
        """Packets the link_down() rules dropped so far."""
        total = 0
        for chain in ("INPUT", "OUTPUT"):
            for line in self.run(["iptables", "-w", "-nvxL", chain]).stdout.splitlines():
                fields = line.split()
                if len(fields) > 2 and fields[2] == "DROP":
                    total += int(fields[0])
        return total

    def _command(self, line: str) -> str:
        with self._delay_lock:
            self._delay.stdin.write(line + "\n")
            self._delay.stdin.flush()
            answer = self._delay.stdout.readline().strip()
        if not answer or answer.startswith("error"):
            raise RuntimeError(f"fabric-delay in {self.ns} answered {answer!r} to {line!r}")
        return answer

    def _setup(self, profile: Profile, sw: str, delay_bin: str) -> None:
        _run("ip", "netns", "add", self.ns)
        _run("ip", "-n", self.ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", "eth0", "netns", self.ns, "type", "veth", "peer", "name", self.port, "netns", sw)
        _run("ip", "-n", self.ns, "addr", "add", f"{self.ip}/24", "dev", "eth0")
        _run("ip", "-n", self.ns, "link", "set", "eth0", "up")
        _run("ip", "-n", sw, "link", "set", self.port, "master", "br0", "up")
        # The host's own egress queue is deep, like a NIC's 1000-packet queue: TCP's small-queue
        # limit keeps it short and a full one pushes back on the socket instead of dropping. The
        # switch port towards the host is shallow (buffer_ms), where senders converging drop.
        _shape(self.ns, "eth0", profile, ["pfifo", "limit", "1000"])
        limit = max(256 << 10, int(profile.rate_bytes_per_s * profile.buffer_ms / 1000))
        _shape(sw, self.port, profile, ["bfifo", "limit", str(limit)])
        if profile.window_bytes:
            w = profile.window_bytes
            self.run(["sysctl", "-qw", f"net.ipv4.tcp_rmem=4096 {min(w, 131072)} {w}",
                      f"net.ipv4.tcp_wmem=4096 {min(w, 16384)} {w}"])
        self.run(["iptables", "-w", "-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE", "--queue-num", "0"])
        self._delay = subprocess.Popen(["ip", "netns", "exec", self.ns, delay_bin, "0", str(profile.delay_us),
                                        str(profile.loss_percent)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True)
        if self._delay.stdout.readline().strip() != "ready":
            raise RuntimeError(f"fabric-delay did not start in {self.ns} (exit {self._delay.wait()})")

    def _teardown(self) -> None:
        for car in self.sidecars:
            car.kill()
        if self._delay is not None and self._delay.poll() is None:
            self._delay.stdin.close()  # it exits when stdin closes
            try:
                self._delay.wait(5)
            except subprocess.TimeoutExpired:
                self._delay.kill()
                self._delay.wait()
        kill_namespace(self.ns)


def _shape(ns: str, dev: str, profile: Profile, queue: list[str]) -> None:
    """HTB at the profile's rate, then `queue` (a tc qdisc and its options) behind it."""
    rate = f"{profile.rate_mbit}mbit"
    tc = ["ip", "netns", "exec", ns, "tc"]
    _run(*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    # quantum: one full GSO packet per round (the default, rate/r2q, is far larger than a packet).
    _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate,
         "quantum", "65536")
    _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *queue)


class Fabric:
    """N hosts on one switch, every NIC shaped by `profile`. Use as a context manager."""

    def __init__(self, hosts: int, profile: Profile = DC):
        if not 1 <= hosts <= 250:
            raise ValueError("1 to 250 hosts")
        self.profile = profile
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.name}-sw"
        self.hosts = [Host(self, i) for i in range(hosts)]
        self.workdir = ""
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> Fabric:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        preflight()
        cleanup_stale()
        delay_bin = delay_binary()
        self.workdir = os.path.join(WORK_ROOT, self.name)
        os.makedirs(self.workdir, exist_ok=True)
        try:
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts:
                h._setup(self.profile, self.switch, delay_bin)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                if f:
                    f.close()
        for h in self.hosts:
            h._teardown()
        kill_namespace(self.switch)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def counters(self) -> dict[str, Counters]:
        return {h.name: h.counters() for h in self.hosts}

