"""Every image archive of `make images`: a valid OCI layout whose config says what the operator
and the chart rely on (non-root user, entrypoint, environment, labels with the version we
publish), and whose entrypoint runs from the unpacked root filesystem. The vLLM-TPU image is
checked as its tpusync layer (images/images.mk says why), imported by real vLLM on TPU's
packages."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tpusync_operator import versions

from . import oci

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / os.environ.get("TPUSYNC_IMAGES", "build/images")
VERSION = versions.TPUSYNC_VERSION
NONROOT = "65532:65532"
SITE_312 = "usr/local/lib/python3.12/site-packages"


def image(name: str) -> oci.Image:
    path = OUT / f"{name}.oci.tar"
    assert path.is_file(), f"{path}: no archive (make images writes it)"
    return oci.read(path)


def local_base(name: str) -> str:
    return (OUT / f"base-{name}").read_text().strip()


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory):
    done: dict[str, tuple[oci.Image, Path]] = {}

    def get(name: str) -> tuple[oci.Image, Path]:
        if name not in done:
            img = image(name)
            done[name] = img, img.unpack(tmp_path_factory.mktemp(name) / "rootfs")
        return done[name]
    return get


def run_in(root: Path, img: oci.Image, argv: list[str], *, user: str | None = NONROOT, extra_env=None):
    """argv in the unpacked image: chroot into its rootfs, as its user, with only its env."""
    env = {**img.env, **(extra_env or {})}
    cmd = ["chroot", *([f"--userspec={user}"] if user else []), str(root), *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def check_common(img: oci.Image, title: str) -> None:
    assert img.ref_name == VERSION
    labels = img.labels
    assert labels["org.opencontainers.image.title"] == title
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.source"] == "https://github.com/tpusync/tpusync"


def test_published_images_are_the_archives():
    """Every image of ours that the defaults name (versions.TPUSYNC) has an archive here, the
    vLLM-TPU image as its layer."""
    names = {ref.rsplit("/", 1)[1].split(":")[0] for ref in versions.TPUSYNC.values["images"]}
    built = {p.name.removesuffix(".oci.tar") for p in OUT.glob("*.oci.tar")}
    assert built == (names - {"tpusync-vllm-tpu"}) | {"tpusync-vllm-tpu-layer"}


@pytest.mark.parametrize("name,entrypoint,ports", [
    ("tpusync-operator", ["python", "-m", "tpusync_operator"], {"8080/tcp", "9090/tcp"}),
    ("tpusync-serving", ["python", "-m", "tpusync.serving"], {"8000/tcp", "5557/tcp"}),
])
def test_python_image_config(name, entrypoint, ports):
    img = image(name)
    check_common(img, name)
    rt = img.runtime
    assert rt["User"] == NONROOT
    assert rt["Entrypoint"] == entrypoint
    assert set(rt["ExposedPorts"]) == ports
    assert img.env["PATH"].startswith("/opt/venv/bin:")
    assert img.env["PYTHONDONTWRITEBYTECODE"] == "1"
    # Built here on the locally assembled base, and the image says so (never the upstream name).
    assert img.labels["org.opencontainers.image.base.name"] == local_base("python3.11")
    # What the local build borrows from this machine (pip's cache, its CA) lives in that base,
    # never in the image's own layers, which are what the release builds on the upstream base.
    history = img.config["history"]
    first_own = next(i for i, h in enumerate(history) if "ARG PYTHON_BASE" in h.get("created_by", ""))
    base_layers = sum(not h.get("empty_layer") for h in history[:first_own])
    own = [m.name for layer in img.layers()[base_layers:] for m in layer.getmembers()]
    assert own and not [n for n in own if n.startswith(("root/.cache", "etc/pip.conf", "etc/ssl/certs/build-ca"))]


def test_operator_runs(unpacked):
    img, root = unpacked("tpusync-operator")
    help_ = run_in(root, img, [*img.runtime["Entrypoint"], "--help"])
    assert help_.returncode == 0, help_.stderr
    assert "--peering" in help_.stdout
    # --help stops before the handlers import: the venv must bring every runtime dependency.
    imports = run_in(root, img, ["python", "-c", "import tpusync_operator.handlers, tpusync._native"])
    assert imports.returncode == 0, imports.stderr
    # the venv is the image's own, on the image's interpreter
    where = run_in(root, img, ["python", "-c", "import sys, tpusync; print(sys.prefix, tpusync.__file__)"])
    assert where.stdout.split() == ["/opt/venv", "/opt/venv/lib/python3.11/site-packages/tpusync/__init__.py"]


def test_serving_runs(unpacked):
    img, root = unpacked("tpusync-serving")
    help_ = run_in(root, img, [*img.runtime["Entrypoint"], "--help"])
    assert help_.returncode == 0, help_.stderr
    assert "--kv-events-endpoint" in help_.stdout
    # JAX with libtpu for TPU nodes; off a TPU, JAX on the CPU computes.
    jax = run_in(root, img, ["python", "-c", "import jax, jax.numpy as jnp, libtpu, tpusync._native; "
                             "print(int(jnp.arange(4).sum()), jax.__version__)"],
                 extra_env={"JAX_PLATFORMS": "cpu"})
    assert jax.returncode == 0, jax.stderr
    assert jax.stdout.split()[0] == "6"


def test_sidecar_image(unpacked):
    img, root = unpacked("tpusync-sidecar")
    check_common(img, "tpusync-sidecar")
    rt = img.runtime
    assert rt["User"] == NONROOT and rt["Entrypoint"] == ["/usr/local/bin/tpusync-sidecar"]
    assert {"7600/tcp", "7601/tcp"} <= set(rt["ExposedPorts"])
    assert img.labels["dev.tpusync.builder-base"] == local_base("bookworm")
    # FROM scratch: one layer, the collected rootfs and nothing else (no shell, no package manager).
    assert len(img.manifest["layers"]) == 1
    assert not (root / "bin/sh").exists() and not (root / "usr/bin").exists()
    assert (root / "etc/passwd").read_text().splitlines()[1].startswith("nonroot:x:65532:65532:")
    help_ = run_in(root, img, [*rt["Entrypoint"], "--help"])
    assert help_.returncode == 0, help_.stderr
    assert "--data-port" in help_.stdout + help_.stderr


def test_vllm_tpu_layer(unpacked):
    """The layer the release puts on vllm/vllm-tpu: tpusync and xxhash under the base's
    site-packages and nothing else, built for CPython 3.12."""
    img, root = unpacked("tpusync-vllm-tpu-layer")
    check = img.labels
    assert check["org.opencontainers.image.title"] == "tpusync-vllm-tpu-layer"
    assert check["org.opencontainers.image.version"] == VERSION
    names = [m.name for layer in img.layers() for m in layer.getmembers() if not m.isdir()]
    assert names and all(n.startswith(SITE_312 + "/") for n in names), [n for n in names if not n.startswith(SITE_312)]
    site = root / SITE_312
    assert list(site.glob("tpusync/_native.cpython-312-x86_64-linux-gnu.so"))
    assert (site / f"tpusync-{VERSION}.dist-info").is_dir() and list(site.glob("xxhash-3.6.0.dist-info"))


def test_vllm_tpu_layer_imports_on_vllm_tpu(unpacked):
    """The layer's packages, first on the path of the tpu-inference tier's Python 3.12 with
    vllm-tpu and tpu-inference at the pinned release: both of tpusync's connectors import, from
    the layer, on the vLLM that vllm/vllm-tpu at that tag carries."""
    python = os.environ.get("TPUSYNC_VLLM_TPU_PYTHON")
    assert python and Path(python).exists(), \
        "TPUSYNC_VLLM_TPU_PYTHON: the tpu-inference tier's python (make images sets it)"
    _, root = unpacked("tpusync-vllm-tpu-layer")
    site = root / SITE_312
    code = ("import importlib.metadata as md, tpusync, tpusync._native, tpusync.vllm.connector, "
            "tpusync.tpu_inference.connector, xxhash; "
            "print(tpusync.__file__); print(md.version('vllm-tpu'), md.version('tpu-inference'))")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu", "HOME": os.environ["HOME"]}
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    file, release = out.stdout.strip().splitlines()[-2:]
    assert file == str(site / "tpusync/__init__.py")
    assert release.split() == [versions.VLLM.version, versions.VLLM.version]
