"""`python -m tpusync_operator ...` (validate, render) as a user runs it, in an environment
that has no cluster unless the caller gives one: HOME (and so ~/.kube/config) a directory of
the test's, no $KUBECONFIG, not in a pod."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness import REPO


def operator_cli(*args: str, home: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    base.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(REPO / "operator"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "tpusync_operator", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, cwd=REPO, timeout=120)
