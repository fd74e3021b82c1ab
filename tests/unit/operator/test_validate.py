"""`python -m tpusync_operator validate` (validate.py): the CRDs' schema and CEL rules as the API
server runs them, without a cluster. The corpus of invalid objects is the one e2e/test_crds.py
holds the real API server to."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from op_helpers import PoolBody, ServingBody

from harness import REPO
from harness.invalid_objects import POOL, SERVING, invalid_objects
from tpusync_operator.builders.common import Owner, pod_templates
from tpusync_operator.builders.engine import vllm_argv
from tpusync_operator.builders.serving import PoolInfo
from tpusync_operator.crdgen import KINDS, build_crd
from tpusync_operator.engine_flags import OWNED_FLAGS, flag_pattern
from tpusync_operator.models import DisaggregatedServingSpec, TPUSyncPoolSpec
from tpusync_operator.serving_plan import OPTIONAL_KINDS, plan_serving
from tpusync_operator.tpu import slice_for
from tpusync_operator.validate import _compiled, _quantity_integer, validate

SAMPLES = sorted((REPO / "samples").glob("*.yaml"))


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tpusync_operator", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, input=stdin, timeout=120)


@pytest.mark.parametrize("obj,message", [c[1:] for c in invalid_objects()], ids=[c[0] for c in invalid_objects()])
def test_every_invalid_object_is_refused_with_its_field_named(obj, message):
    _, errors = validate(obj)
    assert errors, f"accepted: {obj['spec']!r}"
    assert any(message in str(e) for e in errors), [str(e) for e in errors]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_every_sample_and_the_corpus_bases_are_valid(sample):
    for doc in [POOL, SERVING, *yaml.safe_load_all(sample.read_text())]:
        obj, errors = validate(doc)
        assert errors == [], [str(e) for e in errors]
    assert obj["spec"]["routing"]["enabled"] is True        # the CRD's nested defaults, applied


def test_every_rule_of_the_crds_compiles_in_the_evaluator():
    """No rule is skipped because the evaluator lacks a function the API server has."""
    rules = []

    def walk(node):
        if isinstance(node, list):
            for child in node:
                walk(child)
        if isinstance(node, dict):
            rules.extend(v["rule"] for v in node.get("x-kubernetes-validations", []))
            rules.extend(v["messageExpression"] for v in node.get("x-kubernetes-validations", [])
                         if "messageExpression" in v)
            for child in node.values():
                walk(child)
    for kind in KINDS:
        walk(build_crd(kind))
    assert len(rules) > 40
    for rule in rules:
        _compiled(rule)


def test_quantities_are_integers_as_kubernetes_reads_them():
    assert _quantity_integer("1Mi") == 2**20 and _quantity_integer("1.5Gi") == 3 * 2**29
    assert _quantity_integer("100Ti") == 100 * 2**40
    for bad in ("0.5", "1.5k1", "9E9"):
        with pytest.raises(ValueError):
            _quantity_integer(bad)


def test_every_error_of_every_object_at_once(tmp_path):
    """The broken manifests of issue 27, in one file: every error reported, each with its object
    and field; other kinds skipped by name; no traceback; render refuses the same."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all([
        {"apiVersion": "tpusync.dev/v1alpha1", "kind": "TPUSyncPool", "metadata": {"name": "p"},
         "spec": {"tpu": {"type": "v6e", "topology": "2x2"}, "provisioning": {"mode": "gke"},
                  "capacity": {"spot": True, "reservation": "r", "autoscaling": {"maxHosts": 4}},
                  "tiers": {"dramm": "1Gi", "dram": "100Ti", "blockBytes": "3000"}}},
        {"apiVersion": "tpusync.dev/v1alpha1", "kind": "DisaggregatedServng", "metadata": {"name": "s"}, "spec": {}},
        {"apiVersion": "tpusync.dev/v1alpha1", "kind": "DisaggregatedServing", "metadata": {"name": "s2"},
         "spec": {"model": {"name": "m", "uri": "hf://org/m"}, "poolRef": {"name": "p"},
                  "engine": {"type": "reference"}, "kvTransfer": {"connector": "tpu-inference"},
                  "decode": {"args": ["--port=1"]}}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}},
    ]))
    for command in ("validate", "render"):
        res = cli(command, str(bad))
        assert res.returncode == 1 and res.stdout == "" and "Traceback" not in res.stderr, res.stderr
        for text in ["skipped", "v1 Namespace x",
                     "TPUSyncPool default/p: spec.provisioning: Invalid value", "spec.provisioning.gke is required",
                     "spot and reservation are mutually exclusive", 'unknown field "spec.tiers.dramm"',
                     "spec.tiers.blockBytes must be a multiple of 4096",
                     "spec.tiers.dram must be less than the memory of the TPU host",
                     "DisaggregatedServng default/s: kind: tpusync.dev/v1alpha1/DisaggregatedServng is not a kind",
                     "spec.kvTransfer.connector tpu-inference needs spec.engine.type vllm-tpu",
                     "spec.decode.args: --port is rendered by the operator"]:
            assert text in res.stderr, (command, text, res.stderr)


def test_valid_files_validate_silently_and_help_names_the_commands():
    res = cli("validate", *map(str, SAMPLES))
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")
    helptext = cli("--help").stdout
    assert "validate FILE..." in helptext and "render FILE..." in helptext
    res = cli("validate", "--help")
    assert res.returncode == 0 and "CEL" in res.stdout


def test_the_planners_refusals_are_reported_too(tmp_path):
    docs = [d for d in yaml.safe_load_all(SAMPLES[0].read_text()) if d]
    docs[0]["spec"]["tpu"]["topology"] = "3x3"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    res = cli("validate", str(path))
    assert res.returncode == 1 and "spec.tpu.topology '3x3'" in res.stderr, res.stderr


# Switches the engine takes without a value: repeating one in the args changes nothing.
SWITCHES = {"--enable-prefix-caching", "--enable-scale-out", "--disable-radix-cache"}


# Multi-host sglang-jax is not a combination: the planner refuses it (test_operator_expansion.py).
@pytest.mark.parametrize("engine,pool", [(e, p) for e in sorted(OWNED_FLAGS) for p in ("single-host", "multi-host")
                                         if (e, p) != ("sglang-jax", "multi-host")])
def test_every_flag_the_operator_renders_is_one_the_schema_keeps_out_of_args(engine, pool):
    """OWNED_FLAGS is what the CEL rule refuses in spec.<role>.args; it must cover every flag
    the builders put on an engine's command line, or a repeated flag slips through."""
    pool_body = (PoolBody() if pool == "single-host" else PoolBody().v7x("2x2x2").gke(workloadPolicy="wp")).build()
    spec = TPUSyncPoolSpec.model_validate(pool_body["spec"])
    extra = {"sglang-jax": {"engine": {"type": "sglang-jax", "image": "r.example/sgl:main"},
                            "kvTransfer": {"connector": "sglang-jax"}, "routing": {"precisePrefixCache": False}},
             "reference": {"engine": {"type": "reference"}}, "vllm-tpu": {"engine": {"type": "vllm-tpu"}}}[engine]
    model = {"vllm-tpu": {"revision": "v1", "maxModelLen": 1024, "maxPositionEmbeddings": 4096},
             "sglang-jax": {"revision": "v1"}, "reference": {}}[engine]
    body = ServingBody().spec(model=model, **extra).build()
    plan = plan_serving(Owner.from_body(body), DisaggregatedServingSpec.model_validate(body["spec"]),
                        PoolInfo("pool", spec, slice_for(spec.tpu.type, spec.tpu.topology)), set(OPTIONAL_KINDS))
    flags = set()
    for obj in plan.apply:
        for _, tpl in pod_templates(obj):
            for c in tpl["spec"]["containers"]:
                if c["name"] != "engine":
                    continue
                argv = vllm_argv(c) if engine == "vllm-tpu" else c.get("args", [])
                flags |= {a.split("=")[0] for a in argv or [] if a.startswith("--")}
    assert flags
    owned = re.compile(flag_pattern(engine))
    not_owned = {f for f in flags if not owned.match(f)} - SWITCHES
    assert not_owned == set(), f"rendered but not in OWNED_FLAGS[{engine!r}]: {sorted(not_owned)}"
