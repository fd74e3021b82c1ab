"""tests/images/oci.py, the reader the image tier checks archives with, on small layouts made
here: it follows index -> manifest -> config and layers, refuses a blob whose bytes do not match
its digest, and applies whiteouts when it unpacks layers in order."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.images import oci


def tar_bytes(files: dict[str, bytes | None]) -> bytes:
    """A tar of regular files (None: a directory)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                t.addfile(info)
            else:
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def layout(path: Path, layers: list[dict[str, bytes | None]], *, tamper: bool = False) -> Path:
    blobs: dict[str, bytes] = {}

    def put(data: bytes, media: str) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}

    raw = [tar_bytes(files) for files in layers]
    layer_descs = [put(gzip.compress(r), "application/vnd.oci.image.layer.v1.tar+gzip") for r in raw]
    config = {"architecture": "amd64", "os": "linux", "config": {"User": "65532:65532", "Env": ["A=1"]},
              "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(r).hexdigest()}" for r in raw]}}
    config_desc = put(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": layer_descs}
    manifest_desc = put(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
    manifest_desc["annotations"] = {"org.opencontainers.image.ref.name": "0.1.0"}
    if tamper:
        first = layer_descs[0]["digest"].split(":")[1]
        blobs[first] = blobs[first][:-1] + bytes([blobs[first][-1] ^ 1])
    files = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
             "index.json": json.dumps({"schemaVersion": 2, "manifests": [manifest_desc]}).encode(),
             "blobs": None, "blobs/sha256": None, **{f"blobs/sha256/{d}": b for d, b in blobs.items()}}
    path.write_bytes(tar_bytes(files))
    return path


LAYERS = [
    {"etc": None, "etc/keep": b"k", "etc/gone": b"g", "opt": None, "opt/a": b"a", "opt/b": b"b"},
    {"etc": None, "etc/.wh.gone": b"", "opt": None, "opt/.wh..wh..opq": b"", "opt/c": b"c", "etc/keep": b"K"},
]


def test_reads_and_unpacks_with_whiteouts(tmp_path):
    img = oci.read(layout(tmp_path / "x.oci.tar", LAYERS))
    assert img.ref_name == "0.1.0" and img.runtime["User"] == "65532:65532" and img.env == {"A": "1"}
    root = img.unpack(tmp_path / "rootfs")
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == ["etc/keep", "opt/c"]
    assert (root / "etc/keep").read_bytes() == b"K"


def test_a_blob_that_does_not_match_its_digest_is_refused(tmp_path):
    with pytest.raises(AssertionError, match="does not match its digest"):
        oci.read(layout(tmp_path / "x.oci.tar", LAYERS, tamper=True))
