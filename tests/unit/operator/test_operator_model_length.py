"""The context length a serving asks of its engines (spec.model.maxModelLen) is one the model can
serve: at most its config.json's max_position_embeddings (spec.model.maxPositionEmbeddings), or
what RoPE scaling makes of it (spec.model.ropeScaling); the operator refuses anything else,
naming the field, instead of rendering an engine that exits at start-up. The same rules are CEL
in the CRD (e2e/test_crds.py) and vLLM's own check in tests/vllm/test_rendered_args.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from op_helpers import PoolBody, ServingBody

from tpusync_operator.builders.common import Owner
from tpusync_operator.builders.engine import vllm_argv
from tpusync_operator.builders.serving import PoolInfo
from tpusync_operator.models import DisaggregatedServingSpec, TPUSyncPoolSpec
from tpusync_operator.pool_plan import PlanError, check_pool
from tpusync_operator.render import RenderError, render
from tpusync_operator.serving_plan import OPTIONAL_KINDS, plan_serving

SAMPLE = Path(__file__).resolve().parents[3] / "samples" / "v7x-multi-host-vllm.yaml"
# Qwen3-235B-A22B: config.json max_position_embeddings 40960 and rope_theta 1000000, no
# rope_scaling; its model card's YaRN settings (rope_type yarn, original_max_position_embeddings
# 32768, factor 4.0 for 131072 tokens, 2.0 for 65536).
YARN_2 = {"factor": 2.0, "originalMaxPositionEmbeddings": 32768, "ropeTheta": 1000000}


def plan(model: dict, engine: str = "vllm-tpu", **spec):
    body = ServingBody().spec(engine={"type": engine}, model={"name": "m", "uri": "hf://org/m", **model},
                              **spec).build()
    ps = TPUSyncPoolSpec.model_validate(PoolBody().build()["spec"])
    return plan_serving(Owner.from_body(body), DisaggregatedServingSpec.model_validate(body["spec"]),
                        PoolInfo("pool", ps, check_pool(ps)), set(OPTIONAL_KINDS))


def engine_args(p):
    out = []
    for o in p.apply:
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith(("-prefill", "-decode")):
            c = o["spec"]["template"]["spec"]["containers"][0]
            out.append(vllm_argv(c))
    return out


def test_the_v7x_sample_as_it_was_is_refused():
    """The defect: 65536 tokens of Qwen3-235B-A22B (max_position_embeddings 40960, no RoPE
    scaling) in the roles' args; vLLM exits at start-up, so the operator refuses it."""
    docs = [d for d in yaml.safe_load_all(SAMPLE.read_text()) if d]
    serving = next(d for d in docs if d["kind"] == "DisaggregatedServing")
    for key in ("maxModelLen", "maxPositionEmbeddings", "ropeScaling"):
        serving["spec"]["model"].pop(key, None)
    serving["spec"]["prefill"]["args"] = ["--max-model-len=65536"]
    serving["spec"]["decode"]["args"] = ["--max-model-len=65536"]
    with pytest.raises(RenderError, match=r"spec\.prefill\.args.*spec\.model\.maxModelLen"):
        render(docs)


def test_the_v7x_sample_serves_its_length_with_yarn():
    docs = [d for d in yaml.safe_load_all(SAMPLE.read_text()) if d]
    model = next(d for d in docs if d["kind"] == "DisaggregatedServing")["spec"]["model"]
    assert model["maxPositionEmbeddings"] == 40960 and model["maxModelLen"] > 40960
    scaling = model["ropeScaling"]
    assert model["maxModelLen"] <= scaling["originalMaxPositionEmbeddings"] * scaling["factor"]
    rendered = [r.body for r in render(docs)]
    args = [a for o in rendered if o.get("kind") == "LeaderWorkerSet"
            for a in [vllm_argv(o["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0])]]
    assert len(args) == 2
    for a in args:
        assert a[a.index("--max-model-len") + 1] == str(model["maxModelLen"])
        overrides = json.loads(a[a.index("--hf-overrides") + 1])
        assert overrides["max_position_embeddings"] >= model["maxModelLen"]
        assert overrides["rope_parameters"]["rope_theta"] == 1000000


@pytest.mark.parametrize("model,field", [
    ({"maxModelLen": 65536}, "spec.model.maxPositionEmbeddings"),
    ({"maxModelLen": 65536, "maxPositionEmbeddings": 40960}, "spec.model.maxModelLen"),
    ({"maxModelLen": 131073, "maxPositionEmbeddings": 40960,
      "ropeScaling": {**YARN_2, "factor": 4.0}}, "spec.model.ropeScaling"),
    ({"maxModelLen": 65537, "ropeScaling": YARN_2}, "spec.model.ropeScaling"),
])
def test_a_length_the_model_cannot_serve_is_refused(model, field):
    with pytest.raises(PlanError, match=field.replace(".", r"\.")):
        plan(model)


@pytest.mark.parametrize("arg", ["--max-model-len=4096", "--max-model-len", "--max_model_len=4096"])
def test_the_length_is_not_taken_from_the_args(arg):
    with pytest.raises(PlanError, match=r"spec\.decode\.args.*spec\.model\.maxModelLen"):
        plan({}, decode={"args": [arg, "4096"] if "=" not in arg else [arg]})


def test_rope_scaling_owns_the_hf_overrides():
    with pytest.raises(PlanError, match=r"spec\.prefill\.args.*--hf-overrides.*spec\.model\.ropeScaling"):
        plan({"ropeScaling": YARN_2}, prefill={"args": ["--hf-overrides", "{}"]})
    overrides = ["--hf-overrides", '{"architectures": ["X"]}']
    plan({}, prefill={"args": overrides}, decode={"args": overrides})   # fine without it


@pytest.mark.parametrize("model", [{"maxModelLen": 1024, "maxPositionEmbeddings": 2048},
                                   {"ropeScaling": YARN_2}])
def test_only_vllm_takes_the_length_fields(model):
    with pytest.raises(PlanError, match=r"spec\.model\.(maxModelLen|ropeScaling).*vllm-tpu"):
        plan(model, engine="reference")


def test_rendered_lengths():
    assert all("--max-model-len" not in a and "--hf-overrides" not in a for a in engine_args(plan({})))
    within = engine_args(plan({"maxModelLen": 40960, "maxPositionEmbeddings": 40960}))
    assert all(a[a.index("--max-model-len") + 1] == "40960" and "--hf-overrides" not in a for a in within)
    yarn = engine_args(plan({"maxModelLen": 65536, "maxPositionEmbeddings": 40960, "ropeScaling": YARN_2}))
    for a in yarn:
        # vLLM 0.32 replaces rope_parameters whole with a dict override (rope_theta included: without it
        # its get_rope falls back to 10000) and checks --max-model-len against max_position_embeddings,
        # which YaRN leaves at the scaled length (Transformers 5: original x factor).
        assert json.loads(a[a.index("--hf-overrides") + 1]) == {
            "max_position_embeddings": 65536,
            "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768,
                                "rope_theta": 1000000.0}}
        assert a[a.index("--max-model-len") + 1] == "65536"
