"""The release tier: the release workflow's steps (images/release.sh) run for real against an
OCI registry (Debian's docker-registry) started on 127.0.0.1, and the chart installed from it
onto the real control plane.

Runs from `make release-test` (images/images.mk), which sets TPUSYNC_RELEASE_ARCHIVES (the OCI
archives `make images` writes) and TPUSYNC_CONTROLPLANE_DIR; elsewhere this folder collects
nothing, and says so. With its environment set, a missing tool fails the tier, never skips it."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.controlplane import ControlPlaneError, check_controlplane, controlplane_dir
from tests.conftest import not_collected

if not os.environ.get("TPUSYNC_RELEASE_ARCHIVES"):
    collect_ignore_glob = not_collected(
        "tests/release", "no image archives (TPUSYNC_RELEASE_ARCHIVES); `make release-test` builds and runs it")

# What the tier could not check here, and why: printed at the end of the run.
NOT_CHECKED: list[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    for line in NOT_CHECKED:
        terminalreporter.write_line(f"NOT CHECKED HERE {line}", yellow=True, bold=True)


@dataclass(frozen=True)
class Tools:
    registry: Path      # docker-registry (Debian's build of distribution/distribution)
    skopeo: Path
    helm: Path          # the pinned helm v4 of the control-plane cache
    archives: Path


@pytest.fixture(scope="session")
def tools() -> Tools:
    problems = []
    found = {}
    for name, package in (("docker-registry", "docker-registry"), ("skopeo", "skopeo")):
        path = shutil.which(name)
        if path is None:
            problems.append(f"{name} not found (Debian package {package}; `make image-tools` installs it)")
        found[name] = Path(path or name)
    cp_dir = controlplane_dir()
    try:
        check_controlplane(cp_dir)
    except ControlPlaneError as e:
        problems.append(str(e))
    archives = Path(os.environ["TPUSYNC_RELEASE_ARCHIVES"]).resolve()
    if not sorted(archives.glob("*.oci.tar")):
        problems.append(f"{archives}: no *.oci.tar (`make image-archives` writes them)")
    if problems:
        pytest.fail("the release tier cannot run:\n" + "\n".join(problems), pytrace=False)
    return Tools(found["docker-registry"], found["skopeo"], cp_dir / "bin" / "helm", archives)
