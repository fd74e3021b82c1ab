"""imageRegistry: one chart value points every tpusync image at a registry of the user's: the
operator's own (the Deployment) and, through TPUSYNC_IMAGE_REGISTRY, those the operator renders
(versions.from_registry). The chart and the operator take the same values and move the same
references; tests/release installs the chart from a real registry with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from harness import REPO
from harness.helm import CHART, find
from tpusync_operator import versions

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULT_REGISTRY = versions.OPERATOR_IMAGE.rsplit("/", 1)[0]
GOOD = ["us-docker.pkg.dev/my-project/tpusync", "europe-west4-docker.pkg.dev/p-1/repo_a/sub.dir",
        "127.0.0.1:5000", "registry.example.com:8443/team", "localhost", "localhost:5000/x", "ghcr.io/me"]
BAD = ["https://us-docker.pkg.dev/p/r", "us-docker.pkg.dev/p/r/", "myregistry", "myregistry/team",
       "us-docker.pkg.dev/P/r", "us-docker.pkg.dev/p//r", "-bad.example.com", "r.example.com:port",
       "r.example.com/x:1.0", "r.example.com/x@sha256:00", " r.example.com"]


def container(objs):
    (c,) = find(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in c["env"]}


def test_the_schema_and_the_operator_take_one_grammar():
    assert SCHEMA["properties"]["imageRegistry"] == {
        "type": "string", "pattern": f"^({versions.IMAGE_REGISTRY_PATTERN})?$"}


@pytest.mark.parametrize("value", GOOD)
def test_a_registry_is_accepted_by_both(helm, value):
    c = container(helm.template({"imageRegistry": value}))
    assert c["image"] == f"{value}/tpusync-operator:{versions.TPUSYNC_VERSION}"
    assert env_of(c)[versions.IMAGE_REGISTRY_ENV] == value
    assert versions.image_registry({versions.IMAGE_REGISTRY_ENV: value}) == value


@pytest.mark.parametrize("value", BAD)
def test_anything_else_is_refused_by_both(helm, value):
    assert "at '/imageRegistry'" in helm.template_error({"imageRegistry": value})
    with pytest.raises(ValueError, match=versions.IMAGE_REGISTRY_ENV):
        versions.image_registry({versions.IMAGE_REGISTRY_ENV: value})


def test_unset_is_the_release_registry(helm):
    c = container(helm.template())
    assert c["image"] == versions.OPERATOR_IMAGE
    assert versions.IMAGE_REGISTRY_ENV not in env_of(c)
    for env in ({}, {versions.IMAGE_REGISTRY_ENV: ""}):
        assert versions.image_registry(env) == DEFAULT_REGISTRY
        assert {versions.from_registry(ref, env) for ref in versions.TPUSYNC.values["images"]} == \
            versions.TPUSYNC.values["images"]


def test_the_chart_moves_the_operator_image_as_the_operator_moves_its_images(helm):
    """Under the default registry, a repository moves (with a digest too); elsewhere it stays."""
    registry = "us-docker.pkg.dev/my-project/tpusync"
    env = {versions.IMAGE_REGISTRY_ENV: registry}
    c = container(helm.template({"imageRegistry": registry}))
    assert c["image"] == versions.from_registry(versions.OPERATOR_IMAGE, env)
    digest = "sha256:" + "a" * 64
    c = container(helm.template({"imageRegistry": registry, "image": {"digest": digest}}))
    assert c["image"] == f"{registry}/tpusync-operator@{digest}"
    elsewhere = "registry.example.com/ops/tpusync-operator"
    c = container(helm.template({"imageRegistry": registry, "image": {"repository": elsewhere}}))
    assert c["image"] == f"{elsewhere}:{versions.TPUSYNC_VERSION}"
    assert versions.from_registry(f"{elsewhere}:1", env) == f"{elsewhere}:1"
    assert versions.from_registry(f"{DEFAULT_REGISTRY}-fork/x:1", env) == f"{DEFAULT_REGISTRY}-fork/x:1"
    assert {versions.from_registry(ref, env) for ref in versions.TPUSYNC.values["images"]} == \
        {registry + ref.removeprefix(DEFAULT_REGISTRY) for ref in versions.TPUSYNC.values["images"]}


def test_the_operator_renders_every_tpusync_image_from_the_chart_registry(helm):
    """With the environment the chart gives it, the operator's dry run of every sample names
    tpusync's images (sidecar, serving, vllm-tpu) in that registry only; upstream pins stay."""
    registry = "127.0.0.1:5000"
    env = env_of(container(helm.template({"imageRegistry": registry})))
    samples = sorted(str(p) for p in (REPO / "samples").glob("*.yaml"))
    proc = subprocess.run([sys.executable, "-m", "tpusync_operator", "render", *samples], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **{k: v for k, v in env.items()
                                                                        if k == versions.IMAGE_REGISTRY_ENV}})
    assert proc.returncode == 0, proc.stderr
    images = set()

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers"):
                    images.update(c["image"] for c in value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)
    for doc in yaml.safe_load_all(proc.stdout):
        walk(doc)
    ours = {i for i in images if i.startswith(registry + "/")}
    assert {i.removeprefix(registry + "/") for i in ours} == {
        ref.removeprefix(DEFAULT_REGISTRY + "/") for ref in (versions.SIDECAR_IMAGE, versions.SERVING_IMAGE,
                                                             versions.VLLM_TPU_IMAGE)}
    assert images - ours == {versions.EPP.image, versions.ROUTING_PROXY.image}
