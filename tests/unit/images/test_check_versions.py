"""images/check-versions.py: what the release workflow and `make images` run before anything is
published. It passes on this repository and names each disagreement it is built to catch."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_versions", ROOT / "images/check-versions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_versions"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tree(tmp_path, check):
    """A copy of exactly the files the check reads."""
    for rel in check.FILES:
        src, dst = ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} not found"
    path.write_text(text.replace(old, new, 1))


def test_this_repository_agrees(check):
    from tpusync_operator import versions
    assert check.problems(None) == []
    assert check.problems(f"v{versions.TPUSYNC_VERSION}") == []


def test_a_tag_of_another_version_fails(check):
    assert check.problems("v9.9.9") == ["tag v9.9.9: 'v9.9.9', want 'v0.1.0'"]


@pytest.mark.parametrize("rel,old,new,expect", [
    ("charts/tpusync-operator/Chart.yaml", 'appVersion: "0.1.0"', 'appVersion: "0.1.1"',
     "Chart.yaml appVersion"),
    ("charts/tpusync-operator/values.yaml", 'tag: "0.1.0"', 'tag: "0.0.9"', "values.yaml image"),
    ("pyproject.toml", 'version = "0.1.0"', 'version = "0.2.0"', "pyproject.toml version"),
    ("crds/tpusync.dev_tpusyncpools.yaml", "tpusync-sidecar:0.1.0", "tpusync-sidecar:0.0.1",
     "crds/tpusync.dev_tpusyncpools.yaml: default ghcr.io/tpusync/tpusync-sidecar:0.0.1 is not published"),
    ("images/python/Dockerfile", "ARG VERSION=0.1.0", "ARG VERSION=0.1.0-rc1",
     "images/python/Dockerfile ARG VERSION"),
    (".github/workflows/release.yml", "- image: tpusync-vllm-tpu\n", "- image: tpusync-vllm\n",
     "images in versions.TPUSYNC"),
])
def test_each_disagreement_is_named(check, tree, rel, old, new, expect):
    edit(tree / rel, old, new)
    found = check.problems(None, tree)
    assert found and all(expect in p or "is not published" in p for p in found), found
    assert any(expect in p for p in found), found
