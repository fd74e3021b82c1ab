"""`python -m tpusync_operator render FILE...`: the operator's objects for the samples, with no
cluster, as YAML documents."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tpusync_operator.builders.llmd import EPP_HEALTH_PORT
from tpusync_operator.render import main
from tpusync_operator.tpu import slice_for

REPO = Path(__file__).resolve().parents[3]
SAMPLES = sorted((REPO / "samples").glob("*.yaml"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tpusync_operator", "render", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_render_every_sample(sample):
    res = run_cli(str(sample))
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    objects = [d for d in docs if "kind" in d]
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], []).append(o)
        assert o["apiVersion"] and o["metadata"]["namespace"] == "inference", o["metadata"]
        assert o["metadata"]["ownerReferences"][0]["kind"] in ("TPUSyncPool", "DisaggregatedServing")
    source = [d for d in yaml.safe_load_all(sample.read_text()) if d]
    pool = next(d for d in source if d["kind"] == "TPUSyncPool")
    serving = next(d for d in source if d["kind"] == "DisaggregatedServing")
    requests = [d for d in docs if "nodePool" in d]
    if pool["spec"]["provisioning"]["mode"] == "gke":
        assert requests and all(r["nodePool"]["config"]["machineType"] for r in requests)
        assert "POST https://container.googleapis.com/v1/projects/" in res.stdout
    else:
        assert not requests
    # The pool's children, the generated Secret (of a pool that names none), the serving's
    # workloads and llm-d objects.
    assert {"Service", "NetworkPolicy"} <= set(by_kind)
    assert ("Secret" in by_kind) == any("secretName" not in d["spec"].get("auth", {})
                                        for d in source if d["kind"] == "TPUSyncPool")
    # Engines spanning several hosts run as LeaderWorkerSets, one-host engines as Deployments.
    multi_host = slice_for(pool["spec"]["tpu"]["type"], pool["spec"]["tpu"]["topology"]).multi_host
    workload = "LeaderWorkerSet" if multi_host else "Deployment"
    assert {o["metadata"]["name"] for o in by_kind[workload]} >= {f"{serving['metadata']['name']}-prefill",
                                                                  f"{serving['metadata']['name']}-decode"}
    assert "InferencePool" in by_kind and "InferenceObjective" in by_kind
    routing = serving["spec"].get("routing", {})
    assert ("HTTPRoute" in by_kind) == ("gatewayRef" in routing)
    assert ("HealthCheckPolicy" in by_kind) == bool(routing.get("gkeGatewayPolicies"))
    epp_policy = next(o for o in by_kind["NetworkPolicy"] if o["metadata"]["name"].endswith("-epp"))
    assert {"protocol": "TCP", "port": EPP_HEALTH_PORT} in epp_policy["spec"]["ingress"][0]["ports"]


def test_render_reads_several_files_and_stdin(capsys, monkeypatch):
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO(SAMPLES[0].read_text()))
    assert main([str(REPO / "samples" / "v7x-multi-host-vllm.yaml"), "-"]) == 0
    out = capsys.readouterr().out
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(out) if d and "kind" in d}
    assert {"qwen3-8b-decode", "qwen3-235b-decode"} <= names


def test_render_names_a_missing_pool(tmp_path, capsys):
    docs = [d for d in yaml.safe_load_all(SAMPLES[0].read_text()) if d and d["kind"] == "DisaggregatedServing"]
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    assert main([str(path)]) == 1
    assert "spec.poolRef.name" in capsys.readouterr().err


def test_render_refuses_what_the_operator_refuses(tmp_path, capsys):
    docs = [d for d in yaml.safe_load_all(SAMPLES[0].read_text()) if d]
    docs[0]["spec"]["tpu"]["topology"] = "3x3"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    assert main([str(path)]) == 1
    assert "spec.tpu.topology '3x3'" in capsys.readouterr().err


def test_render_with_no_objects_fails(tmp_path, capsys):
    path = tmp_path / "empty.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert main([str(path)]) == 1
    assert "no TPUSyncPool or DisaggregatedServing" in capsys.readouterr().err
