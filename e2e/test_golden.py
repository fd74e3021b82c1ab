"""The operator's golden cases (tests/unit/operator/golden/, the builders' output) checked by
Kubernetes itself: each object goes to the real API server as a server-side-apply dry run
with strict field validation, against the built-in types' schemas and the installed CRDs'
(LeaderWorkerSet, InferencePool, InferenceObjective as llm-d serves it, HTTPRoute). The
golden files catch unintended changes; this is where their content meets a schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support import REPO

GOLDEN = REPO / "tests" / "unit" / "operator" / "golden"
# nodepool-*.yaml are GKE API request bodies, not Kubernetes objects (tests/support/gke_api.py).
CASES = sorted(p for p in GOLDEN.glob("*.yaml") if not p.name.startswith("nodepool-"))


def test_every_case_is_checked() -> None:
    assert len(CASES) >= 8, CASES


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_golden_objects_pass_the_api_servers_validation(cluster, crds, llmd_crds, namespace,
                                                        case: Path) -> None:
    docs = [d for d in yaml.safe_load_all(case.read_text()) if d]
    for d in docs:
        d["metadata"]["namespace"] = namespace
    res = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--validate=strict",
                          "--field-manager=tpusync-operator", "-f", "-", input=yaml.safe_dump_all(docs),
                          check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("serverside-applied (server dry run)") == len(docs), res.stdout


def test_the_dry_run_refuses_an_unknown_field(cluster, crds, namespace) -> None:
    """The check above can fail: strict validation refuses a field the schema lacks."""
    case = GOLDEN / "pool-existing-v6e.yaml"
    doc = next(d for d in yaml.safe_load_all(case.read_text()) if d and d["kind"] == "Service")
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["clusterIp"] = "None"      # the field is clusterIP
    res = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--validate=strict",
                          "--field-manager=tpusync-operator", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert res.returncode != 0 and "clusterIp" in res.stderr, res.stdout + res.stderr
