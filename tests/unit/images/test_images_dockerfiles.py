"""images/*/Dockerfile: pinned base images (a version tag or a digest, never latest), a
non-root USER in the final stage, the entrypoints the chart and the operator expect, and
COPY sources that exist. A small Dockerfile parser, no Docker needed."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))
VERSION_TAG = re.compile(r"^v?\d+(\.\d+)+([-.][A-Za-z0-9.]+)*$")   # 3.11.14-slim-bookworm, 12.12-slim
MOVING = {"latest", "nightly", "edge", "stable", "main", "master", "testing", "unstable", "sid"}


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, op: str) -> str | None:
        values = [arg for o, arg in self.instructions if o == op]
        return values[-1] if values else None


def parse(path: Path) -> list[Stage]:
    text = re.sub(r"\\\n", " ", path.read_text())          # join continuation lines
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, arg = line.partition(" ")
        op, arg = op.upper(), arg.strip()
        if op == "ARG" and not stages:
            k, _, v = arg.partition("=")
            args[k] = v.strip('"')
        elif op == "FROM":
            words = [w for w in arg.split() if not w.startswith("--")]
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, name))
        else:
            assert stages, f"{path}: {op} before FROM"
            stages[-1].instructions.append((op, arg))
    return stages


def exec_form(arg: str) -> list[str]:
    return json.loads(arg) if arg.startswith("[") else shlex.split(arg)


def test_both_images_exist():
    assert [p.parent.name for p in DOCKERFILES] == ["operator", "sidecar"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_base_images_are_pinned(path):
    stages = parse(path)
    names = {s.name for s in stages if s.name}
    for s in stages:
        if s.base == "scratch" or s.base in names:
            continue
        assert "$" not in s.base, f"{path}: unresolved ARG in FROM {s.base}"
        if "@sha256:" in s.base:
            continue
        image, _, tag = s.base.rpartition(":")
        assert image and "/" not in tag, f"{path}: FROM {s.base} has no tag (means :latest)"
        assert tag.lower() not in MOVING and not tag.lower().startswith("nightly"), f"{path}: FROM {s.base}"
        assert VERSION_TAG.match(tag), f"{path}: FROM {s.base}: tag {tag!r} is not a version"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_runtime_runs_as_non_root(path):
    final = parse(path)[-1]
    user = final.last("USER")
    assert user is not None, f"{path}: the final stage sets no USER (would run as root)"
    uid, _, gid = user.partition(":")
    assert uid == "65532" and gid in ("", "65532"), f"{path}: USER {user}"
    # USER is the last word on identity: nothing after it switches back.
    ops = [op for op, _ in final.instructions]
    assert "RUN" not in ops[ops.index("USER"):], f"{path}: RUN after USER"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_multi_stage_and_copy_sources_exist(path):
    stages = parse(path)
    assert len(stages) >= 2 and stages[0].name == "builder"
    for s in stages:
        for op, arg in s.instructions:
            if op in ("COPY", "ADD") and "--from=" not in arg:
                *sources, _dest = exec_form(arg)
                for src in sources:
                    assert (ROOT / src).exists(), f"{path}: COPY {src}: no such path in the repository"
    assert (path.parent / "Dockerfile.dockerignore").exists()


def test_operator_image():
    builder, runtime = parse(ROOT / "images/operator/Dockerfile")
    assert builder.base == runtime.base, "the venv must run on the Python it was built with"
    assert builder.base.startswith("python:3.11.")
    run = " ".join(arg for op, arg in builder.instructions if op == "RUN")
    assert "python -m venv /opt/venv" in run and "/opt/venv/bin/pip install '.[operator]'" in run
    assert "/opt/venv/bin/python -m tpusync_operator --help" in run
    assert exec_form(runtime.last("ENTRYPOINT")) == ["python", "-m", "tpusync_operator"]
    assert "PATH=/opt/venv/bin:$PATH" in runtime.last("ENV")
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in runtime.instructions


def test_sidecar_image():
    builder, runtime = parse(ROOT / "images/sidecar/Dockerfile")
    assert builder.base.startswith("debian:")
    run = " ".join(arg for op, arg in builder.instructions if op == "RUN")
    assert "-G Ninja" in run and "--target tpusync-sidecar" in run and "tpusync-sidecar --help" in run
    assert "collect-rootfs.sh" in run
    assert runtime.base == "scratch"
    assert exec_form(runtime.last("ENTRYPOINT")) == ["/usr/local/bin/tpusync-sidecar"]


def test_chart_and_crd_defaults_use_these_images():
    """The chart deploys the operator image; the CRD default is the sidecar image."""
    import yaml
    values = yaml.safe_load((ROOT / "charts/tpusync-operator/values.yaml").read_text())
    assert values["image"]["repository"].endswith("/tpusync-operator")
    from tpusync_operator.models import SidecarSpec
    assert SidecarSpec().image.split(":")[0].endswith("/tpusync-sidecar")
