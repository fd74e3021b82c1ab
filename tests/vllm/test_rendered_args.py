"""Every vLLM command line the operator renders, for every sample and every engine option that
changes it, parsed by vLLM's own `vllm serve` parser and validated by its serve checks,
EngineArgs and the KVTransferConfig / KVEventsConfig it builds: an unknown, misspelled or
mistyped flag fails here. This is the vLLM of the pinned vllm-tpu image (versions.VLLM), run
on the CPU; no engine is started."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import pytest
import vllm
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.distributed.kv_events import ZmqEventPublisher
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

from tpusync.engines.connector.config import ConnectorConfig
from tpusync.engines.connector.relay import reachable
from tpusync_operator import versions
from tpusync_operator.builders.common import Owner, pod_templates
from tpusync_operator.builders.engine import vllm_argv
from tpusync_operator.builders.serving import PoolInfo
from tpusync_operator.models import DisaggregatedServingSpec, TPUSyncPoolSpec
from tpusync_operator.render import load, render
from tpusync_operator.serving_plan import OPTIONAL_KINDS, plan_serving
from tpusync_operator.tpu import slice_for

SAMPLES = sorted((Path(__file__).resolve().parents[2] / "samples").glob("*.yaml"))
POD_IP = "127.0.0.1"   # what Kubernetes substitutes for $(POD_IP) in args
# The published config.json of every model a sample serves (model_configs/README.md).
MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"
YARN = {"factor": 4.0, "originalMaxPositionEmbeddings": 32768, "ropeTheta": 1000000}


@functools.lru_cache(maxsize=1)
def vllm_parser() -> argparse.ArgumentParser:
    """`vllm` with its `serve` subcommand, as the vllm CLI builds it (built once: parsing does
    not change it)."""
    top = FlexibleArgumentParser(prog="vllm")
    subparsers = top.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return top


def engines(objs):
    """(name, `vllm serve` args) of every engine container in objs that runs vLLM (single-host
    pods and multi-host leaders; Ray workers run no vLLM server)."""
    for o in objs:
        for _, t in pod_templates(o):
            for c in t["spec"]["containers"]:
                args = vllm_argv(c) if c["name"] == "engine" else None
                if args is not None:
                    yield o["metadata"]["name"], args


def option_matrix():
    """Every vllm-tpu option that changes the command line, on a v6e and a v7x multi-host pool."""
    pools = {
        "v6e": {"tpu": {"type": "v6e", "topology": "2x4"}, "provisioning": {"mode": "existing",
                                                                            "existing": {"nodePoolName": "np"}}},
        "v7x": {"tpu": {"type": "v7x", "topology": "2x2x2"},
                "provisioning": {"mode": "gke", "gke": {"project": "my-project", "location": "us-east5", "cluster": "c",
                                                        "workloadPolicy": "wp"}}},
    }
    models = [{"name": "m", "uri": "hf://org/m"},
              {"name": "m", "uri": "hf://org/m", "revision": "v1", "tokenSecretRef": {"name": "hf"}},
              {"name": "m", "uri": "gs://bucket/models/m"},
              {"name": "m", "uri": "/models/m"}]
    routing = [{"enabled": True, "precisePrefixCache": True}, {"enabled": True, "precisePrefixCache": False},
               {"enabled": False}]
    lengths = [{}, {"maxModelLen": 4096, "maxPositionEmbeddings": 8192},
               {"maxModelLen": 131072, "maxPositionEmbeddings": 40960, "ropeScaling": YARN}]
    for (pname, pool), connector, model, route, length in itertools.product(
            pools.items(), ("tpusync", "tpu-inference"), models, routing, lengths):
        spec = DisaggregatedServingSpec.model_validate({
            "model": {**model, **length}, "engine": {"type": "vllm-tpu"}, "poolRef": {"name": "pool"},
            "kvTransfer": {"connector": connector}, "routing": route,
            "prefill": {"args": ["--max-num-seqs=64"]}, "decode": {"args": ["--max-num-seqs=64"]}})
        pool_spec = TPUSyncPoolSpec.model_validate(pool)
        info = PoolInfo("pool", pool_spec, slice_for(pool_spec.tpu.type, pool_spec.tpu.topology))
        owner = Owner("tpusync.dev/v1alpha1", "DisaggregatedServing", "llm", "ns", "uid")
        rev = "rev" if "revision" in model else ""
        ident = f"{pname}-{connector}-{model['uri']}-{rev}-{route}-{length}"
        yield ident, plan_serving(owner, spec, info, set(OPTIONAL_KINDS)).apply


def cases():
    out = []
    sample_objs = [r.body for r in render(load([str(p) for p in SAMPLES])) if "kind" in r.body]
    out += [(f"samples/{name}", args) for name, args in engines(sample_objs)]
    for ident, objs in option_matrix():
        out += [(f"{ident}/{name}", args) for name, args in engines(objs)]
    return out


CASES = cases()


def test_the_pinned_vllm_is_the_one_running_here():
    assert vllm.__version__.split("+")[0] == versions.VLLM_VERSION
    assert any(ident.startswith("samples/") for ident, _ in CASES)   # the v7x sample serves with vLLM


def test_every_recorded_vllm_flag_exists():
    """versions.VLLM.flags (what the unit tests allow) holds only options vLLM's parser knows."""
    parser = vllm_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    known = {s for a in serve._actions for s in a.option_strings}
    assert versions.VLLM.flags <= known, versions.VLLM.flags - known


@pytest.mark.parametrize("args", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_rendered_vllm_serve_args_parse_and_validate(args, capsys):
    argv = ["serve", *(a.replace("$(POD_IP)", POD_IP) for a in args)]
    try:
        ns = vllm_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"vllm serve rejected {argv}: {capsys.readouterr().err}")
    ServeSubcommand().validate(ns)
    engine_args = AsyncEngineArgs.from_cli_args(ns)

    # The positional model is what vLLM loads: a repo id, a gs:// URI or a path, never hf://.
    assert ns.model_tag == args[0] and not ns.model_tag.startswith("hf://")
    assert engine_args.enable_prefix_caching is True
    assert engine_args.tensor_parallel_size == int(args[args.index("--tensor-parallel-size") + 1])

    kv = engine_args.kv_transfer_config
    assert isinstance(kv, KVTransferConfig)
    want = json.loads(args[args.index("--kv-transfer-config") + 1].replace("$(POD_IP)", POD_IP))
    assert kv.kv_connector == want["kv_connector"] and kv.kv_role == want["kv_role"]
    assert kv.kv_connector_module_path == want["kv_connector_module_path"]
    assert kv.is_kv_transfer_instance
    assert kv.kv_load_failure_policy == want.get("kv_load_failure_policy", "fail")
    ev = engine_args.kv_events_config
    assert isinstance(ev, KVEventsConfig) and ev.enable_kv_cache_events and ev.publisher == "zmq"
    assert ev.topic.startswith(f"kv@{POD_IP}:")
    relay_at = (kv.kv_connector_extra_config or {}).get("kv_events_endpoint")
    if relay_at is not None:  # tpusync's connector relays vLLM's publisher, which must bind where it reaches
        assert ConnectorConfig.from_extra(kv.kv_connector_extra_config).kv_events_endpoint == relay_at
        assert ZmqEventPublisher._is_bind_endpoint(ev.endpoint) and reachable(ev.endpoint) == ev.endpoint

    if args[0].startswith("gs://"):
        assert engine_args.load_format == versions.VLLM_STREAMING_LOAD_FORMAT
    if "--revision" in args:
        assert engine_args.revision == args[args.index("--revision") + 1]
    assert ns.enable_scale_out == (versions.VLLM_RENDER_FLAG in args)
    if "--max-model-len" in args:
        assert engine_args.max_model_len == int(args[args.index("--max-model-len") + 1])
    if "--hf-overrides" in args:
        assert engine_args.hf_overrides == json.loads(args[args.index("--hf-overrides") + 1])


def model_config(args: list[str]):
    """vLLM's ModelConfig of a rendered command line, from the model's published config.json
    (MODEL_CONFIGS): it runs vLLM's own context-length check (_get_and_verify_max_len)."""
    from vllm.config import ModelConfig
    engine_args = AsyncEngineArgs.from_cli_args(vllm_parser().parse_args(
        ["serve", *(a.replace("$(POD_IP)", POD_IP) for a in args)]))
    return ModelConfig(model=str(MODEL_CONFIGS / args[0]), max_model_len=engine_args.max_model_len,
                       hf_overrides=engine_args.hf_overrides, skip_tokenizer_init=True)


@pytest.mark.parametrize("args", [c[1] for c in CASES if c[0].startswith("samples/")],
                         ids=[c[0] for c in CASES if c[0].startswith("samples/")])
def test_vllm_accepts_the_samples_context_length_for_their_model(args):
    """The length a sample asks for is one vLLM serves for that model (the v7x sample asked
    Qwen3-235B-A22B, max_position_embeddings 40960, for 65536 tokens without RoPE scaling,
    and vLLM refused to start), and the RoPE scaling it is given keeps the model's rope_theta."""
    assert (MODEL_CONFIGS / args[0] / "config.json").exists(), f"add {args[0]}'s config.json to {MODEL_CONFIGS}"
    published = json.loads((MODEL_CONFIGS / args[0] / "config.json").read_text())
    config = model_config(args)
    if "--max-model-len" in args:
        assert config.max_model_len == int(args[args.index("--max-model-len") + 1])
    rope = config.hf_config.rope_parameters
    assert rope["rope_theta"] == published["rope_theta"], rope
    if "--hf-overrides" in args:
        assert rope["rope_type"] == "yarn" and config.max_model_len > published["max_position_embeddings"]


def test_vllm_refuses_what_the_v7x_sample_asked_before():
    """The check above can fail: 65536 tokens of Qwen3-235B-A22B as the sample had them."""
    before = list(next(args for ident, args in CASES if ident.startswith("samples/qwen3-235b")))
    i = before.index("--hf-overrides")
    del before[i:i + 2]                      # no RoPE scaling, --max-model-len 65536
    assert before[before.index("--max-model-len") + 1] == "65536"
    with pytest.raises(ValueError, match="max_model_len"):
        model_config(before)


def test_render_flag_registers_what_the_token_producer_calls():
    """With the flag our decode engines get, `vllm serve` registers /v1/completions/render
    (vLLM's own router registration); without it the route answers 403."""
    from fastapi import FastAPI
    from fastapi.routing import APIRoute
    from vllm.entrypoints.scale_out.factories import register_scale_out_api_routers

    decode = next(args for ident, args in CASES if ident.startswith("samples/") and versions.VLLM_RENDER_FLAG in args)
    for flags, served in ((decode, True), ([a for a in decode if a != versions.VLLM_RENDER_FLAG], False)):
        ns = vllm_parser().parse_args(["serve", *(a.replace("$(POD_IP)", POD_IP) for a in flags)])
        app = FastAPI()
        app.state.args = ns
        register_scale_out_api_routers(app, ("generate",))
        route = next(r for r in app.routes if isinstance(r, APIRoute) and r.path == "/v1/completions/render")
        assert (route.endpoint.__name__ != "disabled_scale_out") == served


@pytest.mark.parametrize("bad", [
    ["--tensor-paralel-size", "8"],                                                    # misspelled flag
    ["--kv-transfer-config", '{"kv_connector":"TPUConnector","kv_role":"producer"}'],  # not a kv_role
    ["--kv-transfer-config", '{"kv_connector":"TPUConnector","kv_role":"kv_producer","bogus":1}'],
    ["--kv-events-config", '{"enable_kv_cache_events":true,"publisher":"kafka"}'],
], ids=["misspelled-flag", "kv-role", "unknown-kv-field", "events-publisher"])
def test_the_check_fails_on_what_vllm_refuses(bad):
    """The parser these tests rely on refuses a misspelled flag and invalid configs."""
    with pytest.raises(SystemExit):
        vllm_parser().parse_args(["serve", "org/m", *bad])


def test_each_role_of_the_mixed_sample_gets_the_parallelism_of_its_own_pools_slice():
    """Prefill on a v7x 2x2x1 pool (4 chips of 2 TensorCores), decode on a v6e 2x2 pool of its own
    (spec.decode.poolRef): vLLM reads tensor parallelism 8 and 4, and its own check of the model
    against the parallelism (attention heads divisible by it) passes for both."""
    from vllm.config import ParallelConfig
    mixed = {ident.split("/", 1)[1]: args for ident, args in CASES if ident.startswith("samples/qwen3-8b-mixed")}
    assert set(mixed) == {"qwen3-8b-mixed-prefill", "qwen3-8b-mixed-decode"}
    for name, want in (("qwen3-8b-mixed-prefill", 8), ("qwen3-8b-mixed-decode", 4)):
        args = mixed[name]
        engine_args = AsyncEngineArgs.from_cli_args(vllm_parser().parse_args(
            ["serve", *(a.replace("$(POD_IP)", POD_IP) for a in args)]))
        assert engine_args.tensor_parallel_size == want, name
        model_config(args).verify_with_parallel_config(ParallelConfig(tensor_parallel_size=want))
    with pytest.raises(ValueError, match="divisible by tensor parallel size"):     # the check can fail
        model_config(mixed["qwen3-8b-mixed-decode"]).verify_with_parallel_config(ParallelConfig(tensor_parallel_size=3))
