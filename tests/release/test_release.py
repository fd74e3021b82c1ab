"""A release a user can run, run here: the release workflow's own steps (images/release.sh, which
.github/workflows/release.yml calls) push every image archive `make images` built and the chart
(`helm push`) to a real OCI registry started on 127.0.0.1 (Debian's docker-registry, plain HTTP,
which the steps are told explicitly with --plain-http); the chart is installed from that
registry (`helm install oci://...`) onto the real control plane with `imageRegistry` pointing at
it, as docs/gke.md tells a user; and every image reference the installed chart and the operator
render names that registry and resolves there to the digest of the archive it was pushed from.

kwok plays the pods, so no kubelet pulls an image: "resolves" is the registry's answer, by HTTP,
to what a pull asks first (the manifest for the reference, with its digest), and to a HEAD of
every blob that manifest names. What cannot resolve here is said by name and why, at the end of
the run: the vLLM-TPU image, whose upstream base cannot be pulled on this machine (only its
tpusync layer stage is built: images/images.mk); no image is pushed under its name."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import REPO
from harness.cluster import Cluster, running_cluster
from harness.polling import wait_for
from harness.processes import LOOPBACK, Component, free_port
from harness.release import pushed
from harness.release import release_step as harness_release_step
from tpusync_operator import versions

from .conftest import NOT_CHECKED, Tools

VERSION = versions.TPUSYNC_VERSION
RELEASE = "tpusync-operator"
NAMESPACE = "tpusync-system"
CHART_REPOSITORY = "charts/tpusync-operator"
PUBLISHED = {ref.rsplit("/", 1)[1].split(":")[0] for ref in versions.TPUSYNC.values["images"]}
DEFAULT_REGISTRY = versions.OPERATOR_IMAGE.rsplit("/", 1)[0]
# Built here in its place (images/images.mk): only the tpusync layer stage of images/vllm-tpu.
VLLM_TPU, VLLM_TPU_LAYER = "tpusync-vllm-tpu", "tpusync-vllm-tpu-layer"
# What a pull accepts (OCI and Docker image manifests and indexes).
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.oci.image.index.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json",
                  "application/vnd.docker.distribution.manifest.list.v2+json")
INDEX_TYPES = MANIFEST_TYPES[1::2]
HELM_CONFIG = "application/vnd.cncf.helm.config.v1+json"
# Pushing the archives (over a GB) and starting a control plane, on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(600)
# Upstream images the operator renders: their projects publish them, this release does not.
UPSTREAM = {versions.EPP.image, versions.ROUTING_PROXY.image}


# ----- the registry ----------------------------------------------------------------------

@dataclass
class Registry:
    host: str               # 127.0.0.1:PORT: what image references and oci:// URLs name
    process: Component

    def request(self, method: str, path: str, accept: tuple[str, ...] = ()) -> tuple[int, Any, bytes]:
        req = urllib.request.Request(f"http://{self.host}{path}", method=method,
                                     headers={"Accept": ", ".join(accept)} if accept else {})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never a proxy
        try:
            with opener.open(req, timeout=30) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    def json(self, path: str) -> Any:
        status, _, body = self.request("GET", path)
        assert status == 200, f"GET {path}: {status} {body[:300]!r}"
        return json.loads(body)

    def resolve(self, name: str, reference: str) -> tuple[int, str, dict[str, Any]]:
        """GET /v2/NAME/manifests/REFERENCE as a pull does: (status, Docker-Content-Digest,
        manifest); the digest is checked against the bytes served."""
        status, headers, body = self.request("GET", f"/v2/{name}/manifests/{reference}", MANIFEST_TYPES)
        if status != 200:
            return status, "", json.loads(body or b"{}")
        digest = headers["Docker-Content-Digest"]
        assert digest == "sha256:" + hashlib.sha256(body).hexdigest(), f"{name}:{reference}: {digest} is not the body's"
        return status, digest, json.loads(body)

    def missing_blobs(self, name: str, manifest: dict[str, Any]) -> list[str]:
        """What of the image (every manifest of an index, each config and layer) the registry lacks."""
        missing = []
        if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
            for sub in manifest["manifests"]:
                status, _, m = self.resolve(name, sub["digest"])
                missing += [sub["digest"]] if status != 200 else self.missing_blobs(name, m)
            return missing
        for blob in [manifest["config"], *manifest["layers"]]:
            status, _, _ = self.request("HEAD", f"/v2/{name}/blobs/{blob['digest']}")
            if status != 200:
                missing.append(f"{blob['digest']} ({status})")
        return missing


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tpusync-release-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def registry(tools: Tools, workdir: Path) -> Iterator[Registry]:
    """docker-registry on a free 127.0.0.1 port, its storage and config in a temporary directory,
    plain HTTP, no authentication."""
    root = workdir / "registry"
    root.mkdir()
    host = f"{LOOPBACK}:{free_port()}"
    config = {"version": "0.1", "log": {"level": "info"},
              "storage": {"filesystem": {"rootdirectory": str(root / "storage")}},
              "http": {"addr": host, "secret": secrets.token_hex(16)}}
    (root / "config.yml").write_text(yaml.safe_dump(config))
    proc = Component("docker-registry", [str(tools.registry), "serve", str(root / "config.yml")],
                     root / "registry.log")
    reg = Registry(host, proc)
    proc.start()
    try:
        wait_for(f"the registry answering on {host}", lambda: reg.request("GET", "/v2/")[0] == 200, 30,
                 step=proc.check, on_timeout=lambda: "\n" + proc.tail())
        yield reg
    finally:
        proc.stop()


# ----- the release's steps ---------------------------------------------------------------

@dataclass
class Released:
    images: dict[str, str]      # name -> digest, as images/release.sh printed them
    chart: str                  # oci://HOST/charts/tpusync-operator
    chart_digest: str
    output: str


def release_step(tools: Tools, workdir: Path, *args: str) -> str:
    return harness_release_step(workdir, *args, skopeo=str(tools.skopeo), helm=str(tools.helm))


def archives(tools: Tools) -> dict[str, Path]:
    return {p.name.removesuffix(".oci.tar"): p for p in sorted(tools.archives.glob("*.oci.tar"))}


def archive_digest(path: Path) -> str:
    """The digest of the one image of an OCI archive (its index.json)."""
    with tarfile.open(path) as tar:
        member = tar.extractfile("index.json")
        assert member is not None, f"{path}: no index.json"
        index = json.load(member)
    assert len(index["manifests"]) == 1, f"{path}: {index}"
    return str(index["manifests"][0]["digest"])


@pytest.fixture(scope="module")
def released(tools: Tools, workdir: Path, registry: Registry) -> Released:
    """The workflow's steps in its order: the versions (with the tag), every image, the chart."""
    out = release_step(tools, workdir, "check", f"v{VERSION}")
    found = archives(tools)
    out += release_step(tools, workdir, "--plain-http", "push-images", registry.host, VERSION,
                        *(str(p) for p in found.values()))
    out += release_step(tools, workdir, "--plain-http", "chart", registry.host, VERSION, str(workdir / "dist"))
    refs = pushed(out)
    chart = f"oci://{registry.host}/{CHART_REPOSITORY}"
    images = {ref[len(registry.host) + 1:].split(":")[0]: d for ref, d in refs.items() if not ref.startswith("oci://")}
    return Released(images, chart, refs[f"{chart}:{VERSION}"], out)


# ----- the control plane and the chart installed from the registry --------------------------

@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    workdir = Path(tempfile.mkdtemp(prefix="tpusync-release-cluster-"))
    try:
        with running_cluster(workdir) as cl:
            cl.add_cpu_nodes("release", 2)      # where kwok plays the operator's two replicas
            yield cl
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def installed(cluster: Cluster, registry: Registry, released: Released) -> Iterator[subprocess.CompletedProcess[str]]:
    """`helm install oci://...` with the one override docs/gke.md gives: imageRegistry."""
    res = cluster.helm("install", RELEASE, released.chart, "--version", VERSION, "--plain-http",
                       "--namespace", NAMESPACE, "--create-namespace", "--set", f"imageRegistry={registry.host}",
                       "--wait", "--timeout", "120s")
    try:
        yield res
    finally:
        cluster.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "120s", check=False)


def containers(obj: Any) -> Iterator[dict[str, Any]]:
    """Every container and init container anywhere in an object (pod templates of any depth)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from value
            else:
                yield from containers(value)
    elif isinstance(obj, list):
        for item in obj:
            yield from containers(item)


# ----- the tests -------------------------------------------------------------------------

def test_every_archive_and_the_chart_are_in_the_registry(tools, registry, released):
    """The registry holds exactly what the release pushed, at the version, each image by the
    digest of the archive it came from (skopeo copy --preserve-digests) and the chart as a Helm
    chart artifact."""
    found = archives(tools)
    assert set(found) == (PUBLISHED - {VLLM_TPU}) | {VLLM_TPU_LAYER}, sorted(found)
    catalog = registry.json("/v2/_catalog")["repositories"]
    assert sorted(catalog) == sorted([*found, CHART_REPOSITORY])
    for name in catalog:
        assert registry.json(f"/v2/{name}/tags/list")["tags"] == [VERSION], name
    assert set(released.images) == set(found)
    for name, path in found.items():
        status, digest, manifest = registry.resolve(name, VERSION)
        assert status == 200, f"{name}:{VERSION}: {status} {manifest}"
        assert digest == released.images[name] == archive_digest(path), name
        assert registry.missing_blobs(name, manifest) == [], name
    status, digest, manifest = registry.resolve(CHART_REPOSITORY, VERSION)
    assert status == 200 and digest == released.chart_digest
    assert manifest["config"]["mediaType"] == HELM_CONFIG
    assert registry.missing_blobs(CHART_REPOSITORY, manifest) == []


def test_the_chart_installs_from_the_registry(cluster, registry, released, installed):
    """helm pulled the pushed chart (by its digest) and the release rolled out: two peered
    replicas of the operator's image, from the registry, told the registry of the images it
    renders."""
    assert f"Digest: {released.chart_digest}" in installed.stdout + installed.stderr, installed.stderr
    meta = json.loads(cluster.helm("list", "--namespace", NAMESPACE, "--output", "json").stdout)
    assert [(r["name"], r["chart"], r["status"]) for r in meta] == [(RELEASE, f"tpusync-operator-{VERSION}",
                                                                      "deployed")]
    dep = cluster.kubectl_json("get", "deployment", RELEASE, "--namespace", NAMESPACE)
    assert dep["status"].get("availableReplicas") == 2, dep["status"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{registry.host}/tpusync-operator:{VERSION}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[versions.IMAGE_REGISTRY_ENV] == registry.host


def test_every_image_reference_resolves_in_the_registry_by_digest(tools, cluster, registry, released, installed):
    """Every image the installed chart runs (the Deployment and its pods) and every image the
    operator renders for the samples, configured as the chart configures it (the Deployment's
    TPUSYNC_IMAGE_REGISTRY), is either tpusync's, named in the registry and resolving there to
    the digest of its archive, or an upstream pin its project publishes. Every image the release
    publishes is among them."""
    dep = cluster.kubectl_json("get", "deployment", RELEASE, "--namespace", NAMESPACE)
    pods = cluster.kubectl_json("get", "pods", "--namespace", NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}")
    assert len(pods["items"]) == 2
    named_by: dict[str, list[str]] = {}      # ref -> what names it
    for c in containers([dep, pods]):
        named_by.setdefault(c["image"], ["the chart's Deployment"])
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    for sample in sorted((REPO / "samples").glob("*.yaml")):
        proc = subprocess.run([sys.executable, "-m", "tpusync_operator", "render", str(sample)], capture_output=True,
                              text=True, timeout=120,
                              env={**os.environ, versions.IMAGE_REGISTRY_ENV: env[versions.IMAGE_REGISTRY_ENV]})
        assert proc.returncode == 0, f"render {sample.name}: {proc.stderr}"
        for doc in yaml.safe_load_all(proc.stdout):
            for c in containers(doc):
                where = named_by.setdefault(c["image"], [])
                if f"samples/{sample.name}" not in where:
                    where.append(f"samples/{sample.name}")
    refs = {ref: ", ".join(where) for ref, where in named_by.items()}

    ours = {r for r in refs if r.startswith(registry.host + "/")}
    assert not [r for r in refs if r.startswith(DEFAULT_REGISTRY + "/")], refs
    assert set(refs) - ours <= UPSTREAM, (f"neither tpusync's from {registry.host} nor an upstream pin: "
                                         f"{sorted(set(refs) - ours - UPSTREAM)}")
    named = {r[len(registry.host) + 1:].split(":")[0].split("@")[0] for r in ours}
    assert named == PUBLISHED, sorted(named)

    digests = {name: archive_digest(path) for name, path in archives(tools).items()}
    problems = []
    for ref in sorted(ours):
        path = ref[len(registry.host) + 1:]
        name, sep, reference = path.partition("@") if "@" in path else path.partition(":")
        assert sep and reference, ref
        status, digest, manifest = registry.resolve(name, reference)
        if name == VLLM_TPU:
            # Not built here, so never pushed: the registry must say it has no such manifest.
            assert status == 404 and manifest["errors"][0]["code"] in ("MANIFEST_UNKNOWN", "NAME_UNKNOWN"), \
                (status, manifest)
            NOT_CHECKED.append(
                f"{ref} (rendered for {refs[ref]}): not in the registry: its base {versions.VLLM.image} is a "
                f"registry image this machine cannot pull, so only its tpusync layer stage was built and pushed (as "
                f"{VLLM_TPU_LAYER}, resolved above); the release workflow builds and pushes the whole image.")
            continue
        if status != 200:
            problems.append(f"{ref} ({refs[ref]}): {status} {manifest}")
        elif digest != digests.get(name):
            problems.append(f"{ref} ({refs[ref]}): {digest}, but its archive's image is {digests.get(name)}")
        elif missing := registry.missing_blobs(name, manifest):
            problems.append(f"{ref} ({refs[ref]}): the registry lacks {missing}")
    assert not problems, "\n".join(problems)
