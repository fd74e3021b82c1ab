"""The chart tests find helm where the e2e cluster finds its binaries, and fail (never skip)
without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import controlplane
from harness import helm as helm_support
from harness.helm import Helm


def test_missing_helm_says_to_run_make_controlplane(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TPUSYNC_CONTROLPLANE_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(helm_support.HelmNotBuilt, match="make controlplane"):
        helm_support.helm_binary()


def test_same_directory_as_e2e(helm: Helm) -> None:
    assert helm.binary == controlplane.controlplane_dir() / "bin" / "helm"
    assert "v4." in helm.run("version", "--short").stdout
