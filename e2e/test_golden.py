"""The operator's golden cases (tests/unit/operator/golden/, the builders' output) checked by
Kubernetes itself: each object goes to the real API server as a server-side-apply dry run
with strict field validation, against the built-in types' schemas and the installed CRDs'
(LeaderWorkerSet, InferencePool, InferenceObjective as llm-d serves it, HTTPRoute). The
golden files catch unintended changes; this is where their content meets a schema."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from harness import REPO
from tpusync_operator.builders.common import pod_templates

GOLDEN = REPO / "tests" / "unit" / "operator" / "golden"
# nodepool-*.yaml are GKE API request bodies, not Kubernetes objects (harness/gke_api.py).
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


def _pod_templates(docs: list[dict]):
    for d in docs:
        yield from pod_templates(d)


def _tpu_engine(pod_spec: dict) -> bool:
    return any(c["name"] == "engine" and "google.com/tpu" in c.get("resources", {}).get("limits", {})
               for c in pod_spec["containers"])


@pytest.fixture(scope="module")
def pss_namespaces(cluster):
    """Namespaces whose PodSecurity admission enforces the baseline and the restricted standard."""
    names = {}
    for level in ("baseline", "restricted"):
        name = f"pss-{level}-{uuid.uuid4().hex[:6]}"
        cluster.kubectl("create", "namespace", name)
        cluster.kubectl("label", "namespace", name, f"pod-security.kubernetes.io/enforce={level}")
        names[level] = name
    yield names
    for name in names.values():
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.stem)
def test_golden_pods_meet_their_pod_security_standard(cluster, pss_namespaces, case: Path) -> None:
    """The API server's PodSecurity admission on the goldens' pods: every pod fits baseline; every
    pod fits restricted but those of TPU engines, which run as root (not privileged), as GKE
    documents TPU access (builders.security.tpu_engine_security_context)."""
    docs = [d for d in yaml.safe_load_all(case.read_text()) if d]
    checked = 0
    for name, template in _pod_templates(docs):
        spec = {**template["spec"]}
        spec.pop("serviceAccountName", None)      # the Pod's ServiceAccount is not what is checked here
        for level, namespace in pss_namespaces.items():
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name[:50], "namespace": namespace, "labels": template["metadata"]["labels"]},
                   "spec": spec}
            res = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False)
            admitted = level == "baseline" or not _tpu_engine(spec)
            assert (res.returncode == 0) == admitted, (case.stem, name, level, res.stderr)
            if not admitted:
                assert 'violates PodSecurity "restricted' in res.stderr and "runAsNonRoot" in res.stderr, res.stderr
            checked += 1
    assert checked or not case.stem.startswith("serving-"), case.stem
