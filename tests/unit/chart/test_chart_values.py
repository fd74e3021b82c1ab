"""values.yaml and values.schema.json: every key documented, every object closed to unknown
keys, and helm's error for a bad value naming the value."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from harness.helm import CHART

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)


def resolve(node: dict) -> dict:
    ref = node.get("$ref")
    if ref:
        assert ref.startswith("#/$defs/"), ref
        return SCHEMA["$defs"][ref.removeprefix("#/$defs/")]
    return node


def walk(node, path="values"):
    """Yields (path, schema node) for every schema node reachable from node."""
    node = resolve(node)
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")
    for alt in node.get("oneOf", []):
        yield from walk(alt, path)


def test_every_object_rejects_unknown_keys():
    for path, node in walk(SCHEMA):
        if path == "values.global":      # Helm's reserved key, shared with parent charts
            continue
        if node.get("type") == "object":
            extra = node.get("additionalProperties")
            assert extra is False or (isinstance(extra, dict) and extra.get("type") == "string"), \
                f"{path}: objects must set additionalProperties: false (or be a string map)"
            if extra is not False:
                assert "properties" not in node, f"{path}: a map with fixed properties"


def test_schema_and_values_have_the_same_keys():
    def schema_keys(node, prefix=""):
        node = resolve(node)
        out = set()
        for key, sub in node.get("properties", {}).items():
            out.add(prefix + key)
            out |= schema_keys(sub, prefix + key + ".")
        return out

    def value_keys(d, prefix=""):
        out = set()
        for key, v in d.items():
            out.add(prefix + key)
            if isinstance(v, dict) and v and key not in ("resources",):
                out |= value_keys(v, prefix + key + ".")
        return out

    in_schema = {k for k in schema_keys(SCHEMA) if k != "global" and not k.startswith("resources.")}
    in_values = value_keys(VALUES)
    assert in_values == in_schema, (in_values ^ in_schema)


def test_every_value_is_documented():
    """Each key of values.yaml carries a `# --` comment, on itself or on an enclosing key."""
    lines = VALUES_TEXT.splitlines()
    documented: list[tuple[int, bool]] = []       # stack of (indent, documented)
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][\w-]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while documented and documented[-1][0] >= indent:
            documented.pop()
        j = i - 1
        while j >= 0 and lines[j].lstrip().startswith("#") and not lines[j].lstrip().startswith("# --"):
            j -= 1
        own = j >= 0 and lines[j].lstrip().startswith("# --") and len(lines[j]) - len(lines[j].lstrip()) == indent
        inherited = any(d for _, d in documented)
        value = line.split(":", 1)[1].strip()
        if value:   # a leaf
            assert own or inherited, f"values.yaml:{i + 1}: `{m.group(2)}` has no `# --` comment"
        documented.append((indent, own))


@pytest.mark.parametrize("values,where,what", [
    ({"replica": 2}, "at ''", "'replica' not allowed"),
    ({"image": {"tga": "1"}}, "at '/image'", "'tga' not allowed"),
    ({"metrics": {"serviceMonitor": {"intervl": "1m"}}}, "at '/metrics/serviceMonitor'", "'intervl' not allowed"),
    ({"probes": {"liveness": {"periodSecond": 3}}}, "at '/probes/liveness'", "'periodSecond' not allowed"),
    ({"resources": {"requests": {"gpu": 1}}}, "at '/resources/requests'", "'gpu' not allowed"),
    ({"tolerations": [{"key": "k", "efect": "NoSchedule"}]}, "at '/tolerations/0'", "'efect' not allowed"),
    ({"peering": {"prio": 1}}, "at '/peering'", "'prio' not allowed"),
])
def test_schema_rejects_unknown_keys_with_a_clear_error(helm, values, where, what):
    err = helm.template_error(values)
    assert "don't meet the specifications of the schema" in err
    assert where in err and "additional properties" in err and what in err, err


@pytest.mark.parametrize("values,where", [
    ({"replicas": -1}, "/replicas"),
    ({"podAntiAffinity": "maybe"}, "/podAntiAffinity"),
    ({"watchNamespaces": ["Not_A_Namespace"]}, "/watchNamespaces/0"),
    ({"image": {"digest": "sha256:xyz"}}, "/image/digest"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"peering": {"priority": "high"}}, "/peering/priority"),
    ({"metrics": {"port": 70000}}, "/metrics/port"),
    ({"podLabels": {"tier": 1}}, "/podLabels/tier"),
    ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory"),
])
def test_schema_rejects_bad_values(helm, values, where):
    err = helm.template_error(values)
    assert f"at '{where}'" in err, err


def test_operator_image_is_the_pinned_release():
    """The chart and the operator name one release: versions.TPUSYNC (the version table)."""
    from tpusync_operator import versions
    image = VALUES["image"]
    assert f"{image['repository']}:{image['tag']}" == versions.OPERATOR_IMAGE
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == versions.TPUSYNC_VERSION
    assert versions.OPERATOR_IMAGE in versions.TPUSYNC.values["images"]
