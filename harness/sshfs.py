"""A real network filesystem between simulated hosts: OpenSSH's sftp server in one host of a
fabric (harness/fabric.py) exporting a directory, mounted with sshfs (FUSE) by processes
started in the others. Renames, access times, O_DIRECT and close-to-open behaviour are sshfs's
over the fabric's links, not a local disk's."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess

from . import fabric as fab
from .polling import wait_for

PORT = 2222
SFTP_SERVER = "/usr/lib/openssh/sftp-server"


def preflight() -> None:
    """Fails loudly, naming what is missing: this tier never skips."""
    missing = [b for b in ("sshfs", "/usr/sbin/sshd", "ssh-keygen", "fusermount3") if shutil.which(b) is None]
    if not os.path.exists("/dev/fuse"):
        missing.append("/dev/fuse")
    if missing:
        raise RuntimeError(f"the sshfs tier needs {missing} (make system-deps installs sshfs and openssh-server)")


class SftpExport:
    """sshd in `host`, exporting `export` to key-authenticated root logins from the fabric."""

    def __init__(self, host: fab.Host, export: str, workdir: str) -> None:
        preflight()
        self.host, self.export, self.workdir = host, export, workdir
        os.makedirs(export, exist_ok=True)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        self.key = os.path.join(workdir, "client_key")
        host_key = os.path.join(workdir, "host_key")
        for path in (self.key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
        authorized = os.path.join(workdir, "authorized_keys")
        shutil.copy(self.key + ".pub", authorized)
        config = os.path.join(workdir, "sshd_config")
        with open(config, "w") as f:
            f.write(f"ListenAddress {host.ip}\nPort {PORT}\nHostKey {host_key}\nAuthorizedKeysFile {authorized}\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                    f"UsePAM no\nStrictModes no\nPidFile {workdir}/sshd.pid\nSubsystem sftp {SFTP_SERVER}\n")
        self.sshd = host.popen(["/usr/sbin/sshd", "-D", "-e", "-f", config], stderr=subprocess.DEVNULL)
        wait_for(f"sshd listening on {host.ip}:{PORT}", self._listening, timeout=30)
        self.mounts: list[str] = []

    def _listening(self) -> bool:
        def probe() -> bool:
            with socket.socket() as s:
                s.settimeout(1)
                return s.connect_ex((self.host.ip, PORT)) == 0
        return fab.in_namespace(self.host.ns, probe)

    def mount_command(self, mountpoint: str) -> str:
        """The shell command that mounts the export at `mountpoint` (run it in another host)."""
        self.mounts.append(mountpoint)
        opts = ",".join([f"IdentityFile={self.key}", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null",
                         "BatchMode=yes", f"port={PORT}", "reconnect"])
        return (f"mkdir -p {shlex.quote(mountpoint)} && sshfs -o {shlex.quote(opts)} "
                f"root@{self.host.ip}:{shlex.quote(self.export)} {shlex.quote(mountpoint)}")

    def close(self) -> None:
        # The sshfs daemons outlive the sidecars that mounted through them: stop them by mount point.
        for mountpoint in self.mounts:
            subprocess.run(["pkill", "-f", f"sshfs .* {mountpoint}$"], check=False)
        if self.sshd.poll() is None:
            self.sshd.kill()
        self.sshd.wait()
