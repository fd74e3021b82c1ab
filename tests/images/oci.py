"""Reads an OCI image archive (an OCI image layout in a tar, as `buildah push oci-archive:`
writes it): the index, the manifest, the config and the layers, each blob checked against its
digest and size, and unpacks the layers into a root filesystem (whiteouts applied)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar+gzip", "application/vnd.oci.image.layer.v1.tar")


@dataclass
class Image:
    path: Path
    index: dict
    manifest: dict
    config: dict
    blobs: dict[str, bytes]

    @property
    def ref_name(self) -> str | None:
        return self.index["manifests"][0].get("annotations", {}).get("org.opencontainers.image.ref.name")

    @property
    def runtime(self) -> dict:
        return self.config.get("config", {})

    @property
    def labels(self) -> dict[str, str]:
        return self.runtime.get("Labels") or {}

    @property
    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.runtime.get("Env") or [])

    def layers(self) -> list[tarfile.TarFile]:
        return [tarfile.open(fileobj=io.BytesIO(self.blobs[d["digest"]])) for d in self.manifest["layers"]]

    def unpack(self, root: Path) -> Path:
        """Applies the layers in order into root, as a container runtime would."""
        root.mkdir(parents=True, exist_ok=True)
        for layer in self.layers():
            for member in layer.getmembers():
                parent, name = os.path.split(member.name)
                if name == ".wh..wh..opq":                  # opaque directory: drop what lower layers put there
                    target = root / parent
                    for child in target.iterdir() if target.is_dir() else ():
                        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
                    continue
                if name.startswith(".wh."):                 # a whiteout: the file is deleted
                    target = root / parent / name[len(".wh."):]
                    if target.is_dir() and not target.is_symlink():
                        shutil.rmtree(target)
                    elif target.exists() or target.is_symlink():
                        target.unlink()
                    continue
                target = root / member.name
                if (target.is_symlink() or target.exists()) and not (member.isdir() and target.is_dir()):
                    shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
                layer.extract(member, root, numeric_owner=True, filter="fully_trusted")
        return root


def _blob(tar: tarfile.TarFile, descriptor: dict) -> bytes:
    algo, _, hexdigest = descriptor["digest"].partition(":")
    assert algo == "sha256", descriptor
    data = tar.extractfile(f"blobs/sha256/{hexdigest}").read()
    assert hashlib.sha256(data).hexdigest() == hexdigest, f"blob {descriptor['digest']} does not match its digest"
    assert len(data) == descriptor["size"], \
        f"blob {descriptor['digest']}: {len(data)} bytes, descriptor says {descriptor['size']}"
    return data


def read(path: Path) -> Image:
    with tarfile.open(path) as tar:
        layout = json.load(tar.extractfile("oci-layout"))
        assert layout == {"imageLayoutVersion": "1.0.0"}, layout
        index = json.load(tar.extractfile("index.json"))
        assert index["schemaVersion"] == 2 and len(index["manifests"]) == 1, index
        desc = index["manifests"][0]
        assert desc["mediaType"] == MANIFEST, desc
        manifest = json.loads(_blob(tar, desc))
        assert manifest["schemaVersion"] == 2 and manifest["config"]["mediaType"] == CONFIG, manifest
        blobs = {manifest["config"]["digest"]: _blob(tar, manifest["config"])}
        for layer in manifest["layers"]:
            assert layer["mediaType"] in LAYER_TYPES, layer
            blobs[layer["digest"]] = _blob(tar, layer)
    config = json.loads(blobs[manifest["config"]["digest"]])
    assert config["os"] == "linux" and config["architecture"] == "amd64", config
    assert len(config["rootfs"]["diff_ids"]) == len(manifest["layers"])
    return Image(path, index, manifest, config, blobs)
