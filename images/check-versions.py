"""Checks that every version we publish agrees: the package, the version table the operator
renders from (operator/tpusync_operator/versions.py), the chart (version, appVersion, image
tag), the image defaults in the generated CRDs, each images/*/Dockerfile's VERSION, and the
images the release workflow publishes. Given a tag (`v0.1.0`), it must name that version too.
Run by `make images` and by .github/workflows/release.yml before anything is pushed.

    python images/check-versions.py [TAG]
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# What is read, relative to the repository root (tests/unit/images copies these to alter them).
FILES = ("pyproject.toml", "operator/tpusync_operator/versions.py", "charts/tpusync-operator/Chart.yaml",
         "charts/tpusync-operator/values.yaml", "charts/tpusync-operator/crds", "crds", "images",
         ".github/workflows/release.yml")


def load_versions(root: Path = ROOT):
    # By path: the version table has no dependencies, the operator package has many.
    spec = importlib.util.spec_from_file_location("versions", root / "operator/tpusync_operator/versions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["versions"] = module          # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def released_images(workflow: Path, registry: str, version: str) -> set[str]:
    """The image references release.yml pushes: <registry>/<matrix image>:<tag version>."""
    jobs = yaml.safe_load(workflow.read_text())["jobs"]
    return {f"{registry}/{entry['image']}:{version}" for entry in jobs["images"]["strategy"]["matrix"]["include"]}


def problems(tag: str | None, root: Path = ROOT) -> list[str]:
    v = load_versions(root)
    chart_dir = root / "charts/tpusync-operator"
    workflow = root / ".github/workflows/release.yml"
    version = v.TPUSYNC_VERSION
    out: list[str] = []

    def same(what: str, found: object, want: object = version) -> None:
        if found != want:
            out.append(f"{what}: {found!r}, want {want!r}")

    if tag is not None:
        same(f"tag {tag}", tag, f"v{version}")
    same("pyproject.toml version", tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    same("Chart.yaml version", chart["version"])
    same("Chart.yaml appVersion", chart["appVersion"])
    values = yaml.safe_load((chart_dir / "values.yaml").read_text())
    same("values.yaml image", f"{values['image']['repository']}:{values['image']['tag']}", v.OPERATOR_IMAGE)

    registry = v.OPERATOR_IMAGE.rsplit("/", 1)[0]
    published = released_images(workflow, registry, version)
    same("images in versions.TPUSYNC", set(v.TPUSYNC.values["images"]), published)
    for name in ("OPERATOR_IMAGE", "SIDECAR_IMAGE", "SERVING_IMAGE", "VLLM_TPU_IMAGE"):
        if getattr(v, name) not in published:
            out.append(f"versions.{name} {getattr(v, name)} is not published by {workflow.name}")

    # Every image of ours that a CRD defaults to (crds/ and the chart's copy) is published.
    ours = re.compile(re.escape(registry) + r"/[a-z0-9-]+:[^\s'\"]+")
    for crd in sorted([*(root / "crds").glob("*.yaml"), *(chart_dir / "crds").glob("*.yaml")]):
        for ref in ours.findall(crd.read_text()):
            if ref not in published:
                out.append(f"{crd.relative_to(root)}: default {ref} is not published by {workflow.name}")

    arg = re.compile(r"^ARG VERSION=(\S+)$", re.M)
    for dockerfile in sorted((root / "images").glob("*/Dockerfile")):
        same(f"{dockerfile.relative_to(root)} ARG VERSION", arg.findall(dockerfile.read_text()), [version])
    return out


def main(argv: list[str]) -> int:
    found = problems(argv[1] if len(argv) > 1 else None)
    for p in found:
        print(f"check-versions: {p}", file=sys.stderr)
    if not found:
        print(f"check-versions: every published version is {load_versions().TPUSYNC_VERSION}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
