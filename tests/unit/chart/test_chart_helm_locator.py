"""The chart tests find helm where the e2e suite finds it, and fail (never skip) without it."""

from __future__ import annotations

import pytest

import chart_helm


def test_missing_helm_says_to_run_make_controlplane(monkeypatch, tmp_path):
    monkeypatch.setenv("TPUSYNC_CONTROLPLANE_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(chart_helm.HelmNotBuilt, match="make controlplane"):
        chart_helm.helm_binary()


def test_same_directory_as_e2e(helm):
    cluster = chart_helm._e2e_cluster()
    assert helm.binary == cluster.controlplane_dir() / "bin" / "helm"
    assert "v4." in helm.run("version", "--short").stdout
