"""The shared tier's integration harness: a pool of n simulated hosts of the fabric harness
(harness/fabric.py), each with a sidecar on one shared directory, either a local
directory or a real network filesystem: sshfs (FUSE) mounts of an sftp export in another host,
over the fabric's links (harness/sshfs.py)."""

from __future__ import annotations

import glob
import os
import re

import numpy as np

import tpusync
from harness import fabric as fab
from harness import sshfs
from harness.keys import keys_for
from tests.integration.conftest import engine
from tpusync.local.sidecars import write_secret

SECRET = b"shared-tier-integration-secret-0123"
BLOCK = 256 << 10
FILE_BYTES = 4096 + BLOCK  # a block's file: header + payload
LAYOUT = "model=test;dtype=bf16;tp=1;rank=0"


def data_for(keys: np.ndarray) -> list[np.ndarray]:
    return [np.random.default_rng([int(hi), int(lo)]).integers(0, 256, BLOCK, dtype=np.uint8) for hi, lo in keys]


def stored(car, tag: int, n: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """n blocks stored through `car` and flushed (with write-through: on the shared tier)."""
    keys = keys_for(tag, n)
    data = data_for(keys)
    with engine(car) as e:
        e.put(keys, data)
        e.flush()
    return keys, data


def read_back(store: tpusync.KVStore, keys) -> list[np.ndarray | None]:
    """Each block's bytes as the store returns them, None for a miss."""
    out = [np.zeros(BLOCK, np.uint8) for _ in keys]
    found = store.get(keys, out)
    return [o if f else None for o, f in zip(out, found)]


def metric(car, name: str) -> float:
    m = re.search("^" + re.escape(name) + r" (\S+)$", car.metrics(), re.M)
    assert m, f"{name} not on /metrics"
    return float(m.group(1))


def pulled_bytes(car) -> float:
    """Block bytes this sidecar moved over the network, in either direction."""
    return sum(float(v) for v in re.findall(r"^tpusync_transfer_bytes_total\{[^}]*\} (\S+)$", car.metrics(), re.M))


class Pool:
    """n hosts, each with a sidecar on the pool's shared directory (the mount point in `sshfs`
    mode: host 0 exports the directory, every other host mounts it)."""

    def __init__(self, tmp_path, mode: str, n: int, size: str | None) -> None:
        self.tmp, self.mode, self.n = tmp_path, mode, n
        self.secret_file = str(tmp_path / "secret")
        write_secret(tmp_path / "secret", SECRET + b"\n")
        self.export = str(tmp_path / "shared")
        os.makedirs(self.export, exist_ok=True)
        # A filesystem of `size` as the shared directory, mounted before any host's process starts
        # (each host's mount namespace is a copy made when the process starts).
        self.mounted = size is not None
        if self.mounted:
            fab._run("mount", "-t", "tmpfs", "-o", f"size={size}", "tpusync-shared-test", self.export)
        self.fabric = fab.Fabric(n, fab.DC)
        self.fabric.start()
        self.sftp = sshfs.SftpExport(self.fabric.hosts[0], self.export, str(tmp_path)) if mode == "sshfs" else None
        self.cars: list[fab.FabricSidecar | None] = [None] * n

    def start(self, i: int, *, dram_bytes: int = 16 * BLOCK, shared_bytes: int = 0, policy: str = "write-through",
              evict_ms: int = 60000, layout: str = LAYOUT, secret: bytes | None = None) -> fab.FabricSidecar:
        """Host i's sidecar on the shared directory; `secret`: another pool's, on the same directory."""
        host = self.fabric.hosts[i]
        secret_file = self.secret_file
        if secret is not None:
            secret_file = str(self.tmp / f"secret-{i}-{len(host.sidecars)}")
            write_secret(secret_file, secret + b"\n")
        prelude, shared_dir = None, self.export
        if self.sftp is not None and i > 0:
            shared_dir = str(self.tmp / f"mnt{i}")
            prelude = self.sftp.mount_command(shared_dir)
        extra = [f"--shared-dir={shared_dir}", f"--shared-layout={layout}", f"--shared-bytes={shared_bytes}",
                 f"--shared-policy={policy}", f"--shared-evict-interval-ms={evict_ms}"]
        car = host.sidecar(secret_file=secret_file, dram_bytes=dram_bytes, block_bytes=BLOCK, extra=extra,
                           prelude=prelude, data_port=fab.DATA_PORT + 2 * len(host.sidecars),
                           http_port=fab.HTTP_PORT + 2 * len(host.sidecars))
        self.cars[i] = car
        return car

    def files(self) -> list[str]:
        return glob.glob(f"{self.export}/tpusync-shared-v2/*/*/??/*")

    def temp_files(self) -> list[str]:
        return glob.glob(f"{self.export}/tpusync-shared-v2/*/*/tmp/*")

    def close(self) -> None:
        self.fabric.close()
        if self.sftp is not None:
            self.sftp.close()
        if self.mounted:
            fab._run("umount", "-l", self.export)
