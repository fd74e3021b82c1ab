"""The generated CRDs: structural, with defaults, enums, CEL rules naming fields, status
subresource, printer columns, short names and categories; and crds/ matches the models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from tpusync_operator import crdgen
from tpusync_operator.crdgen import SchemaError, build_crd, structural_schema

CRDS = Path(__file__).resolve().parents[3] / "crds"


def walk(node: Any, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.get("properties", {}).items():
            yield from walk(v, f"{path}.{k}")
        for k in ("items", "additionalProperties"):
            if isinstance(node.get(k), dict):
                yield from walk(node[k], f"{path}[]")


@pytest.mark.parametrize("kind", ["TPUSyncPool", "DisaggregatedServing"])
def test_schema_is_structural(kind):
    schema = build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        assert not {"anyOf", "oneOf", "allOf", "$ref", "title", "$defs"} & node.keys(), path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
    # preserve-unknown-fields is not used anywhere in our own kinds
    assert not any(n.get("x-kubernetes-preserve-unknown-fields") for _, n in walk(schema))


@pytest.mark.parametrize("kind,plural,short", [("TPUSyncPool", "tpusyncpools", "tsp"),
                                               ("DisaggregatedServing", "disaggregatedservings", "dsv")])
def test_crd_metadata(kind, plural, short):
    crd = build_crd(kind)
    assert crd["metadata"]["name"] == f"{plural}.tpusync.dev"
    names = crd["spec"]["names"]
    assert short in names["shortNames"] and names["categories"] == ["tpusync"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"]["status"] == {}
    # A serving scales by units (kubectl scale, HPA); a pool is sized by its capacity.
    assert version["subresources"].get("scale") == ({
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"} if kind == "DisaggregatedServing" else None)
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert "Age" in columns


def _props(kind: str) -> dict[str, Any]:
    return build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]


def test_pool_defaults_and_enums():
    spec = _props("TPUSyncPool")["spec"]["properties"]
    assert spec["tpu"]["properties"]["type"]["enum"] == ["v5e", "v6e", "v7x"]
    assert spec["provisioning"]["properties"]["mode"]["enum"] == ["gke", "existing"]
    assert spec["sidecar"]["default"] == {}
    assert spec["sidecar"]["properties"]["dataPort"]["default"] == 7600
    assert spec["sidecar"]["properties"]["kvEventsPort"]["default"] == 5557
    assert spec["tiers"]["properties"]["dram"]["default"] == "16Gi"
    assert set(_props("TPUSyncPool")["spec"]["required"]) == {"tpu", "provisioning"}


def test_serving_enums_and_defaults():
    spec = _props("DisaggregatedServing")["spec"]["properties"]
    assert spec["engine"]["properties"]["type"]["enum"] == ["vllm-tpu", "sglang-jax", "reference"]
    routing = spec["routing"]["properties"]
    assert routing["pdThresholdTokens"]["default"] == 16
    assert routing["scorerWeights"]["properties"]["prefixCache"]["default"] == 2.0
    assert spec["kvTransfer"]["properties"]["connector"]["enum"] == ["tpusync", "tpu-inference", "tpu-sync-compatible",
                                                                    "sglang-jax"]


@pytest.mark.parametrize("kind", ["TPUSyncPool", "DisaggregatedServing"])
def test_every_cel_message_names_a_field(kind):
    rules = [r for _, n in walk(_props(kind)["spec"]) for r in n.get("x-kubernetes-validations", [])]
    assert rules, "expected CEL rules"
    for r in rules:
        assert r["message"].startswith("spec."), r


def test_cel_rules_present_where_expected():
    spec = _props("TPUSyncPool")["spec"]["properties"]
    cap_rules = [r["rule"] for r in spec["capacity"]["x-kubernetes-validations"]]
    assert "!(has(self.hosts) && has(self.autoscaling))" in cap_rules
    prov_rules = [r["rule"] for r in spec["provisioning"]["x-kubernetes-validations"]]
    assert "self.mode == oldSelf.mode" in prov_rules


def test_conditions_are_a_map_list():
    conditions = _props("TPUSyncPool")["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) >= {"type", "status", "reason", "lastTransitionTime"}


def test_unions_are_rejected():
    class Bad(BaseModel):
        x: int | str

    with pytest.raises(SchemaError, match="x: a union"):
        structural_schema(Bad, "spec")


def test_committed_crds_match_models():
    assert crdgen.check(CRDS) == [], "crds/ is stale: run `make crds`"


def test_check_reports_drift(tmp_path):
    crdgen.write(tmp_path)
    assert crdgen.check(tmp_path) == []
    f = tmp_path / "tpusync.dev_tpusyncpools.yaml"
    f.write_text(f.read_text().replace("shortNames", "shortnames"))
    diffs = crdgen.check(tmp_path)
    assert len(diffs) == 1 and "shortnames" in diffs[0]
    assert crdgen.main(["--check", str(tmp_path)]) == 1


def test_a_pool_names_no_gke_api_endpoint():
    """The GKE API the operator sends its token to is operator configuration only: the CRD has
    no such field, so the API server prunes it (and refuses it under strict validation), and
    the operator's model does not read one either."""
    gke = build_crd("TPUSyncPool")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["provisioning"]["properties"]["gke"]
    assert "apiEndpoint" not in gke["properties"] and not gke.get("x-kubernetes-preserve-unknown-fields")
    assert not any("endpoint" in path.lower() or "url" in path.lower() for path, _ in walk(gke))
    from tpusync_operator.models import GKEProvisioning
    parsed = GKEProvisioning.model_validate({"project": "my-project", "location": "us-east5", "cluster": "c",
                                             "apiEndpoint": "https://attacker.example"})
    assert "https://attacker.example" not in repr(parsed.model_dump())
