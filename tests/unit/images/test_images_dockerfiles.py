"""images/*/Dockerfile: a Dockerfile (and target) for each image the defaults name, as the
release workflow builds them; upstream bases pinned by digest and given as build-args (so
`make images` can pass its locally assembled bases), a non-root USER in each image's final
stage, COPY sources that exist and that the build context admits. A small Dockerfile parser,
no Docker needed. The built images themselves (user, entrypoint, env, labels,
a run of the entrypoint) are checked from their OCI archives in tests/images."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))


@dataclass(frozen=True)
class Image:
    name: str
    dockerfile: Path
    target: str | None


def released() -> list[Image]:
    """What .github/workflows/release.yml builds: image, Dockerfile directory, target."""
    import yaml
    jobs = yaml.safe_load((ROOT / ".github/workflows/release.yml").read_text())["jobs"]
    return [Image(e["image"], ROOT / "images" / e["dir"] / "Dockerfile", e.get("target"))
            for e in jobs["images"]["strategy"]["matrix"]["include"]]


IMAGES = released()
VERSION_TAG = re.compile(r"^v?\d+(\.\d+)+([-.][A-Za-z0-9.]+)*$")   # 3.11.14-slim-bookworm, 12.12-slim
MOVING = {"latest", "nightly", "edge", "stable", "main", "master", "testing", "unstable", "sid"}


@dataclass
class Stage:
    base: str
    name: str | None
    written: str = ""          # the FROM argument as written (before ARG defaults)
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
            stages.append(Stage(base, name, words[0]))
        else:
            assert stages, f"{path}: {op} before FROM"
            stages[-1].instructions.append((op, arg))
    return stages


def exec_form(arg: str) -> list[str]:
    return json.loads(arg) if arg.startswith("[") else shlex.split(arg)


def top_args(path: Path) -> dict[str, str]:
    text = path.read_text().split("\nFROM ", 1)[0]
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def test_every_published_image_has_a_dockerfile_and_every_dockerfile_is_built():
    """versions.TPUSYNC names what the release publishes; the release builds each from a
    Dockerfile (and its target stage) that exists, and no Dockerfile is left unbuilt."""
    from tpusync_operator import versions
    names = sorted(ref.rsplit("/", 1)[1].split(":")[0] for ref in versions.TPUSYNC.values["images"])
    assert sorted(i.name for i in IMAGES) == names
    assert sorted({i.dockerfile for i in IMAGES}) == DOCKERFILES
    for image in IMAGES:
        stages = {s.name for s in parse(image.dockerfile)}
        assert image.target is None or image.target in stages, f"{image.name}: no stage {image.target}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_upstream_bases_are_pinned_build_args(path):
    """Every upstream base is an ARG *_BASE (make images passes its local bases through it)
    whose default is pinned: by digest, except vllm/vllm-tpu, pinned by the release tag of the
    vLLM the operator renders for (versions.VLLM; the release workflow resolves its digest)."""
    from tpusync_operator import versions
    stages = parse(path)
    names = {s.name for s in stages if s.name}
    args = top_args(path)
    for s in stages:
        if s.base == "scratch" or s.base in names:
            continue
        arg = re.fullmatch(r"\$\{(\w+_BASE)\}", s.written)
        assert arg, f"{path}: FROM {s.written}: an upstream base must be an ARG *_BASE"
        ref = args[arg.group(1)]
        assert ref.startswith("docker.io/"), f"{path}: {ref}: name the registry"
        if arg.group(1) == "VLLM_TPU_BASE":
            assert ref == versions.VLLM.image
            continue
        image, _, digest = ref.partition("@sha256:")
        assert re.fullmatch(r"[0-9a-f]{64}", digest), f"{path}: {ref} is not pinned by digest"
        tag = image.rpartition(":")[2]
        assert tag.lower() not in MOVING and VERSION_TAG.match(tag), f"{path}: {ref}: tag {tag!r} is not a version"


def final_stage(image: Image) -> Stage:
    stages = parse(image.dockerfile)
    return next(s for s in stages if s.name == image.target) if image.target else stages[-1]


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.name)
def test_runtime_runs_as_non_root(image):
    final, path = final_stage(image), image.dockerfile
    user = final.last("USER")
    if image.name == "tpusync-vllm-tpu":
        # vllm/vllm-tpu runs as root (upstream's image, no USER); tpusync's layer keeps that.
        assert user is None
        return
    assert user is not None, f"{path}: the final stage sets no USER (would run as root)"
    uid, _, gid = user.partition(":")
    assert uid == "65532" and gid in ("", "65532"), f"{path}: USER {user}"
    # USER is the last word on identity: nothing after it switches back.
    ops = [op for op, _ in final.instructions]
    assert "RUN" not in ops[ops.index("USER"):], f"{path}: RUN after USER"


def admitted(ignore: Path, src: str) -> bool:
    """Whether a Dockerfile.dockerignore of the form `*` + `!path` lines admits src."""
    allowed = [line[1:].rstrip("/") for line in ignore.read_text().splitlines() if line.startswith("!")]
    return any(src.rstrip("/") == a or src.startswith(a + "/") for a in allowed)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_multi_stage_and_copy_sources_exist(path):
    stages = parse(path)
    ignore = path.parent / "Dockerfile.dockerignore"
    assert len(stages) >= 2 and stages[0].name == "builder" and ignore.exists()
    assert ignore.read_text().splitlines()[1] == "*", "the context admits only what is named"
    for s in stages:
        for op, arg in s.instructions:
            if op in ("COPY", "ADD") and "--from=" not in arg:
                *sources, _dest = exec_form(arg)
                for src in sources:
                    assert (ROOT / src).exists(), f"{path}: COPY {src}: no such path in the repository"
                    assert admitted(ignore, src), f"{path}: COPY {src}: excluded by {ignore.name}"


def test_python_images_share_one_builder():
    """The operator and serving images are targets of one Dockerfile whose venvs take the same
    wheel from its one builder stage: the native extension compiles once and both ship it."""
    op, serving = (i for i in IMAGES if i.name in ("tpusync-operator", "tpusync-serving"))
    assert op.dockerfile == serving.dockerfile
    stages = {s.name: s for s in parse(op.dockerfile)}
    for target in (op.target, serving.target):
        venv = next(arg for o, arg in stages[target].instructions if o == "COPY" and "--from=" in arg)
        venv_stage = stages[venv.split("--from=")[1].split()[0]]
        assert ("COPY", "--from=builder /wheels/ /wheels/") in venv_stage.instructions


def test_chart_and_crd_defaults_use_these_images():
    """The chart deploys the operator image; the CRD default is the sidecar image."""
    import yaml

    from tpusync_operator import versions
    values = yaml.safe_load((ROOT / "charts/tpusync-operator/values.yaml").read_text())
    assert f"{values['image']['repository']}:{values['image']['tag']}" == versions.OPERATOR_IMAGE
    from tpusync_operator.models import SidecarSpec
    assert SidecarSpec().image == versions.SIDECAR_IMAGE
