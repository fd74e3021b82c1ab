"""The pinned helm binary (helm v4, built by `make controlplane` into the e2e control-plane
cache) found where the e2e cluster finds its binaries (harness/controlplane.py: the
same ~/.cache/tpusync/controlplane/<key>/bin, the same TPUSYNC_CONTROLPLANE_DIR), and small
wrappers to render the chart and pick objects out of what it renders."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness import REPO
from harness.controlplane import ControlPlaneError, check_controlplane, controlplane_dir

CHART = REPO / "charts" / "tpusync-operator"


class HelmNotBuilt(RuntimeError):
    pass


def helm_binary() -> Path:
    """Path of the pinned helm; raises HelmNotBuilt (saying to run `make controlplane`)."""
    try:
        cp_dir = controlplane_dir()
        check_controlplane(cp_dir)
    except (ControlPlaneError, subprocess.CalledProcessError) as e:
        raise HelmNotBuilt(f"helm is not built: {e}\nRun `make controlplane` (the chart tests use the "
                           "pinned helm from the e2e control-plane cache).") from e
    return cp_dir / "bin" / "helm"


class HelmFailed(AssertionError):
    def __init__(self, args: list[str], proc: subprocess.CompletedProcess[str]):
        super().__init__(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        self.proc = proc
        self.output = proc.stdout + proc.stderr


@dataclass
class Helm:
    binary: Path
    home: Path          # HELM_CACHE_HOME / HELM_CONFIG_HOME / HELM_DATA_HOME: nothing under ~

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.home),
               "HELM_CACHE_HOME": str(self.home / "cache"), "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_DATA_HOME": str(self.home / "data")}
        proc = subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=env, timeout=120,
                              check=False)
        if check and proc.returncode != 0:
            raise HelmFailed(list(args), proc)
        return proc

    def _values_args(self, values: dict[str, Any] | None, files: Iterable[Path | str]) -> list[str]:
        args: list[str] = []
        for f in files:
            args += ["-f", str(f)]
        if values is not None:
            fd, path = tempfile.mkstemp(suffix=".yaml", dir=self.home)
            with open(fd, "w") as fh:
                yaml.safe_dump(values, fh)
            args += ["-f", path]
        return args

    def template(self, values: dict[str, Any] | None = None, *, files: Iterable[Path | str] = (),
                 release: str = "tpusync", namespace: str = "tpusync-system",
                 extra: Iterable[str] = ()) -> list[dict[str, Any]]:
        """Renders the chart; returns its objects (CRDs excluded unless extra has --include-crds)."""
        proc = self.run("template", release, str(CHART), "--namespace", namespace,
                        *self._values_args(values, files), *extra)
        return [d for d in yaml.safe_load_all(proc.stdout) if d]

    def template_error(self, values: dict[str, Any] | None = None, *, files: Iterable[Path | str] = (),
                       release: str = "tpusync") -> str:
        """Renders the chart expecting a failure; returns helm's message."""
        proc = self.run("template", release, str(CHART), *self._values_args(values, files), check=False)
        assert proc.returncode != 0, f"helm template unexpectedly succeeded with {values}:\n{proc.stdout[:2000]}"
        return proc.stderr

    def notes(self, values: dict[str, Any] | None = None, *, release: str = "tpusync") -> str:
        proc = self.run("install", release, str(CHART), "--dry-run=client", "--namespace", "tpusync-system",
                        *self._values_args(values, ()))
        return proc.stdout.split("NOTES:", 1)[1] if "NOTES:" in proc.stdout else ""


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None,
         namespace: str | None = None) -> dict[str, Any]:
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
            and (namespace is None or o["metadata"].get("namespace") == namespace)]
    assert len(hits) == 1, (f"expected one {kind} {name or ''} {namespace or ''}, got {len(hits)}: "
                            f"{[(o['kind'], o['metadata']['name']) for o in objs]}")
    return hits[0]


def kinds(objs: list[dict[str, Any]]) -> list[str]:
    return sorted(o["kind"] for o in objs)
