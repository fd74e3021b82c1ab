"""The generated CRDs on a real API server: they install, the samples validate with their
defaults applied, and invalid objects are rejected by the API server itself (OpenAPI
schema and CEL rules) with a message that names the offending field."""

from __future__ import annotations

import json

import pytest
import yaml

from harness import REPO
from harness.invalid_objects import POOL, SERVING, invalid_objects, variant
from harness.polling import wait_for


def server_dry_run(cluster, namespace: str, obj: dict):
    return cluster.kubectl("create", "--dry-run=server", "-n", namespace, "-o", "json",
                           "-f", "-", input=json.dumps(obj), check=False)


def test_kubectl_apply_crds(cluster, tpusync_crds):
    assert set(tpusync_crds) == {"tpusyncpools.tpusync.dev", "disaggregatedservings.tpusync.dev",
                                 "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    # Applying again is a no-op, not an error.
    out = cluster.kubectl("apply", "-f", str(REPO / "crds")).stdout
    assert out.count("unchanged") == 4, out
    crd = cluster.kubectl_json("get", "crd", "tpusyncpools.tpusync.dev")
    assert crd["spec"]["names"]["shortNames"] == ["tsp", "tpupool"]
    assert crd["spec"]["versions"][0]["subresources"] == {"status": {}}
    # The category and the field docs are served (fresh discovery: no stale kubectl cache).
    assert crd["spec"]["names"]["categories"] == ["tpusync"]
    cache = f"--cache-dir={cluster.workdir / 'kubectl-cache-crds'}"
    assert cluster.kubectl(cache, "get", "tpusync", "-A").returncode == 0
    # The OpenAPI document kubectl explain reads is republished a moment after the CRD is Established.
    explain = wait_for("the CRD's OpenAPI schema to be published",
                       lambda: cluster.kubectl("explain", "tpusyncpool.spec.tpu", check=False).stdout, 60)
    assert "topology" in explain and "TPU generation" in explain


@pytest.mark.parametrize("sample", sorted((REPO / "samples").glob("*.yaml")), ids=lambda p: p.stem)
def test_samples_validate_with_defaults(cluster, tpusync_crds, namespace, sample):
    for doc in yaml.safe_load_all(sample.read_text()):
        doc["metadata"]["namespace"] = namespace
        res = server_dry_run(cluster, namespace, doc)
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        if doc["kind"] == "TPUSyncPool":
            # Nested defaults applied by the API server from the schema.
            assert got["spec"]["sidecar"]["dataPort"] == 7600
            assert got["spec"]["tiers"]["blockBytes"] == doc["spec"]["tiers"].get("blockBytes", "1Mi")
            assert got["spec"]["auth"] == doc["spec"].get("auth", {})     # {}: the default object
        else:
            assert got["spec"]["routing"]["enabled"] is True
            assert got["spec"]["port"] == 8000
            connector = doc["spec"].get("kvTransfer", {}).get("connector", "tpusync")
            assert got["spec"]["kvTransfer"]["connector"] == connector


@pytest.mark.parametrize("obj,message", [c[1:] for c in invalid_objects()], ids=[c[0] for c in invalid_objects()])
def test_invalid_objects_rejected(cluster, tpusync_crds, namespace, obj, message):
    """The corpus `validate` is held to too (tests/unit/operator/test_validate.py)."""
    base = POOL if obj["kind"] == "TPUSyncPool" else SERVING
    assert server_dry_run(cluster, namespace, base).returncode == 0   # the base is valid
    res = server_dry_run(cluster, namespace, obj)
    assert res.returncode != 0, f"accepted: {obj['spec']!r}"
    assert message in res.stderr, res.stderr


def test_lockstep_needs_both_roles(cluster, tpusync_crds, namespace):
    lockstep = variant(SERVING, "spec.rollout", {"strategy": "Lockstep"})
    assert server_dry_run(cluster, namespace, lockstep).returncode == 0
    assert server_dry_run(cluster, namespace, variant(SERVING, "spec.decode", {"replicas": 0})).returncode == 0
    res = server_dry_run(cluster, namespace, variant(lockstep, "spec.decode", {"replicas": 0}))
    assert res.returncode != 0
    assert "spec.rollout.strategy Lockstep needs spec.prefill.replicas and spec.decode.replicas above 0" in res.stderr


@pytest.mark.parametrize("connector", ["tpu-inference", "tpu-sync-compatible"])
def test_tpu_inference_connectors_need_vllm_tpu(cluster, tpusync_crds, namespace, connector):
    obj = variant(SERVING, "spec.kvTransfer", {"connector": connector})
    assert server_dry_run(cluster, namespace, obj).returncode == 0          # vllm-tpu, the default engine
    res = server_dry_run(cluster, namespace, variant(obj, "spec.engine", {"type": "reference"}))
    assert res.returncode != 0
    assert f"spec.kvTransfer.connector {connector} needs spec.engine.type vllm-tpu" in res.stderr, res.stderr


def test_sglang_jax_needs_its_own_pd_an_image_and_no_precise_routing(cluster, tpusync_crds, namespace):
    ok = variant(variant(variant(SERVING, "spec.engine", {"type": "sglang-jax", "image": "r.example/sgl:main"}),
                         "spec.kvTransfer", {"connector": "sglang-jax"}),
                 "spec.routing", {"precisePrefixCache": False})
    assert server_dry_run(cluster, namespace, ok).returncode == 0
    for path, value, message in [
        ("spec.kvTransfer", {"connector": "tpusync"}, "spec.kvTransfer.connector: sglang-jax is required by"),
        ("spec.engine", {"type": "sglang-jax"}, "spec.engine.image is required with spec.engine.type sglang-jax"),
        ("spec.routing", {"precisePrefixCache": True}, "spec.routing.precisePrefixCache must be false"),
        ("spec.engine", {"type": "vllm-tpu"}, "spec.kvTransfer.connector: sglang-jax is required by"),
    ]:
        res = server_dry_run(cluster, namespace, variant(ok, path, value))
        assert res.returncode != 0, f"accepted: {path}={value!r}"
        assert message in res.stderr, (path, res.stderr)


def test_a_gke_api_endpoint_is_refused(cluster, tpusync_crds, namespace):
    """spec.provisioning.gke.apiEndpoint is gone (the GKE API the operator's token goes to is
    operator configuration): a pool still naming it is refused, the field named; without
    strict validation the API server prunes it (e2e/test_operator_gke.py)."""
    gke = {"mode": "gke", "gke": {"project": "my-project", "location": "us-east5", "cluster": "c",
                                  "apiEndpoint": "https://gke.example.invalid"}}
    res = server_dry_run(cluster, namespace, variant(POOL, "spec.provisioning", gke))
    assert res.returncode != 0
    assert "spec.provisioning.gke.apiEndpoint" in res.stderr, res.stderr


def test_provisioning_mode_is_immutable(cluster, tpusync_crds, namespace):
    """A transition rule (oldSelf): checked on update only."""
    pool = variant(POOL, "metadata.namespace", namespace)
    cluster.kubectl("create", "-f", "-", input=json.dumps(pool))
    patch = {"spec": {"provisioning": {"mode": "gke", "gke": {
        "project": "my-project", "location": "us-east5", "cluster": "c"}}}}
    res = cluster.kubectl("patch", "tpusyncpool", "p", "-n", namespace, "--type=merge",
                          "-p", json.dumps(patch), check=False)
    assert res.returncode != 0
    assert "spec.provisioning.mode is immutable" in res.stderr, res.stderr
    # Other fields stay editable.
    cluster.kubectl("patch", "tpusyncpool", "p", "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"tiers": {"dram": "8Gi"}}}))
    got = cluster.kubectl_json("get", "tpusyncpool", "p", "-n", namespace)
    assert got["spec"]["tiers"]["dram"] == "8Gi"
    assert got["spec"]["provisioning"]["mode"] == "existing"


def test_serving_engine_type_is_immutable(cluster, tpusync_crds, namespace):
    serving = variant(variant(SERVING, "metadata.namespace", namespace), "spec.engine", {"type": "reference"})
    cluster.kubectl("create", "-f", "-", input=json.dumps(serving))
    res = cluster.kubectl("patch", "disaggregatedserving", "s", "-n", namespace, "--type=merge",
                          "-p", json.dumps({"spec": {"engine": {"type": "vllm-tpu"}}}), check=False)
    assert res.returncode != 0
    assert "spec.engine.type is immutable" in res.stderr, res.stderr
    cluster.kubectl("patch", "disaggregatedserving", "s", "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"engine": {"type": "reference", "image": "r.example/x:1"}}}))
    got = cluster.kubectl_json("get", "disaggregatedserving", "s", "-n", namespace)
    assert (got["spec"]["engine"]["type"], got["spec"]["engine"]["image"]) == ("reference", "r.example/x:1")


def test_gs_models_only_with_vllm(cluster, tpusync_crds, namespace):
    """gs:// weights are streamed by vLLM (engine vllm-tpu, the default): another engine is refused."""
    gs = variant(SERVING, "spec.model.uri", "gs://bucket/m")
    assert server_dry_run(cluster, namespace, variant(gs, "spec.engine", {"type": "vllm-tpu"})).returncode == 0
    res = server_dry_run(cluster, namespace, variant(gs, "spec.engine", {"type": "reference"}))
    assert res.returncode != 0 and "gs:// models are streamed by vLLM" in res.stderr, res.stderr


def test_a_model_length_the_model_cannot_serve_is_refused(cluster, tpusync_crds, namespace):
    """spec.model.maxModelLen is within maxPositionEmbeddings, or within what ropeScaling makes of
    the pretrained length (the operator's planner checks the same: test_operator_model_length.py)."""
    yarn = {"factor": 2, "originalMaxPositionEmbeddings": 32768, "ropeTheta": 1000000}   # factor as a JSON int
    for model in ({"maxModelLen": 40960, "maxPositionEmbeddings": 40960},
                  {"maxModelLen": 65536, "maxPositionEmbeddings": 40960, "ropeScaling": yarn},
                  {"ropeScaling": yarn}):
        ok = variant(SERVING, "spec.model", {"name": "m", "uri": "hf://org/m", **model})
        res = server_dry_run(cluster, namespace, ok)
        assert res.returncode == 0, (model, res.stderr)
    for model, message in [
        ({"maxModelLen": 65536}, "spec.model.maxModelLen needs spec.model.maxPositionEmbeddings"),
        ({"maxModelLen": 65536, "maxPositionEmbeddings": 40960},
         "spec.model.maxModelLen must not exceed spec.model.maxPositionEmbeddings without spec.model.ropeScaling"),
        ({"maxModelLen": 65537, "maxPositionEmbeddings": 40960, "ropeScaling": yarn},
         "spec.model.maxModelLen must not exceed spec.model.ropeScaling.originalMaxPositionEmbeddings x factor"),
        ({"ropeScaling": {**yarn, "type": "linear"}}, "spec.model.ropeScaling.type"),
        ({"ropeScaling": {"factor": 2, "originalMaxPositionEmbeddings": 32768}}, "spec.model.ropeScaling.ropeTheta"),
    ]:
        res = server_dry_run(cluster, namespace, variant(SERVING, "spec.model", {"name": "m", "uri": "hf://org/m",
                                                                                 **model}))
        assert res.returncode != 0, f"accepted: {model!r}"
        assert message in res.stderr, (model, res.stderr)
    short = {"name": "m", "uri": "hf://org/m", "maxModelLen": 1, "maxPositionEmbeddings": 2}
    res = server_dry_run(cluster, namespace, variant(variant(SERVING, "spec.model", short),
                                                     "spec.engine", {"type": "reference"}))
    assert res.returncode != 0
    assert "spec.model.maxModelLen and spec.model.ropeScaling apply only to spec.engine.type vllm-tpu" in res.stderr


def test_an_engine_security_context_kubernetes_would_refuse_is_refused(cluster, tpusync_crds, namespace):
    """spec.engine.securityContext replaces fields of the engine container's; a combination the
    pod could not have is refused with the field named (the planner checks the same)."""
    for engine in ({"securityContext": {"runAsUser": 65532, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}},
                   {"type": "reference", "cpuOnly": True, "securityContext": {"runAsNonRoot": True}},
                   {"securityContext": {"privileged": True, "allowPrivilegeEscalation": True,
                                        "capabilities": {"add": ["IPC_LOCK"]}}}):
        res = server_dry_run(cluster, namespace, variant(SERVING, "spec.engine", engine))
        assert res.returncode == 0, (engine, res.stderr)
    for engine, message in [
        ({"securityContext": {"runAsNonRoot": True}}, "spec.engine.securityContext.runAsNonRoot: true needs"),
        ({"securityContext": {"runAsNonRoot": True, "runAsUser": 0}},
         "spec.engine.securityContext.runAsNonRoot: true needs"),
        ({"securityContext": {"privileged": True}}, "spec.engine.securityContext.privileged: true needs"),
        ({"securityContext": {"runAsUser": -1}}, "spec.engine.securityContext.runAsUser"),
    ]:
        res = server_dry_run(cluster, namespace, variant(SERVING, "spec.engine", engine))
        assert res.returncode != 0, f"accepted: {engine!r}"
        assert message in res.stderr, (engine, res.stderr)
