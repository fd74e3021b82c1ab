"""Google's published schema of the GKE API, to hold request bodies against: the container v1
discovery document (every field and enum of NodePool, NodeConfig, PlacementPolicy, ...), as
it ships in the google-api-python-client wheel on PyPI at
googleapiclient/discovery_cache/documents/container.v1.json.

The wheel is pinned; pip downloads it once (only that file is kept) into
~/.cache/tpusync/gke-discovery/<pin>/. `problems(schema, value)` lists what the schema does
not allow: unknown fields (GKE refuses them: "Invalid JSON payload received. Unknown name"),
wrong JSON types, values outside an enum.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

PIN = "google-api-python-client==2.202.0"   # discovery document revision 20261027
MEMBER = "googleapiclient/discovery_cache/documents/container.v1.json"
CACHE = Path.home() / ".cache" / "tpusync" / "gke-discovery" / PIN.replace("==", "-")


def document_path() -> Path:
    """The cached discovery document, downloaded with pip on first use."""
    path = CACHE / "container.v1.json"
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, PIN],
                       check=True, timeout=600)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            data = z.read(MEMBER)
        part = Path(tmp) / "container.v1.json"
        part.write_bytes(data)
        os.replace(part, path)
    return path


@functools.cache
def schemas() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(document_path().read_text())
    assert doc["name"] == "container" and doc["version"] == "v1", (doc["name"], doc["version"])
    found: dict[str, Any] = doc["schemas"]
    return found


def problems(schema: str, value: Any) -> list[str]:
    """What schema `schema` (e.g. "CreateNodePoolRequest") does not allow in `value`."""
    out: list[str] = []
    _check({"$ref": schema}, value, schema, out)
    return out


def _check(spec: dict[str, Any], value: Any, where: str, out: list[str]) -> None:
    if "$ref" in spec:
        spec = schemas()[spec["$ref"]]
    kind = spec.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            out.append(f"{where}: {value!r} is not an object")
            return
        props, extra = spec.get("properties"), spec.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                _check(props[key], item, f"{where}.{key}", out)
            elif extra is not None:
                _check(extra, item, f"{where}.{key}", out)
            else:
                out.append(f"{where}: unknown field {key!r}")
    elif kind == "array":
        if not isinstance(value, list):
            out.append(f"{where}: {value!r} is not an array")
            return
        for i, item in enumerate(value):
            _check(spec["items"], item, f"{where}[{i}]", out)
    elif kind == "string":
        # 64-bit integers travel as JSON strings; GKE also takes them as numbers.
        numeric = spec.get("format") in ("int64", "uint64") and isinstance(value, int) and not isinstance(value, bool)
        if not isinstance(value, str) and not numeric:
            out.append(f"{where}: {value!r} is not a string")
        elif "enum" in spec and value not in spec["enum"]:
            out.append(f"{where}: {value!r} is not one of {spec['enum']}")
    elif kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            out.append(f"{where}: {value!r} is not an integer")
    elif kind == "boolean" and not isinstance(value, bool):
        out.append(f"{where}: {value!r} is not a boolean")
    elif kind == "number" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        out.append(f"{where}: {value!r} is not a number")
