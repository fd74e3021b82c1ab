"""The release's own steps (images/release.sh, what .github/workflows/release.yml runs), run by the
tiers that need a registry filled as a release fills it: tests/release (a registry on
127.0.0.1) and tests/cluster (the real nodes' registry)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import REPO


def release_step(workdir: Path, *args: str, skopeo: str = "skopeo", helm: str = "helm") -> str:
    """images/release.sh with the tools of this machine, helm's state and skopeo's temporary
    files in `workdir`; its output (AssertionError with it when it fails)."""
    env = {**os.environ, "PYTHON": sys.executable, "SKOPEO": skopeo, "HELM": helm,
           "HELM_CACHE_HOME": str(workdir / "helm/cache"), "HELM_CONFIG_HOME": str(workdir / "helm/config"),
           "HELM_DATA_HOME": str(workdir / "helm/data"), "TMPDIR": str(workdir / "tmp")}
    (workdir / "tmp").mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["bash", str(REPO / "images/release.sh"), *args], capture_output=True, text=True,
                          env=env, cwd=workdir, timeout=600, check=False)
    assert proc.returncode == 0, (f"images/release.sh {' '.join(args)} exited {proc.returncode}:\n"
                                  f"{proc.stdout}{proc.stderr}")
    return proc.stdout


def pushed(output: str) -> dict[str, str]:
    """The "pushed REF@DIGEST" lines of images/release.sh: REF -> DIGEST."""
    refs = [line.split(" ", 1)[1] for line in output.splitlines() if line.startswith("pushed ")]
    return dict(ref.rsplit("@", 1) for ref in refs)
