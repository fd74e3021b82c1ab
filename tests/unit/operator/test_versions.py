"""Every flag, plugin type, connector and API version the builders render belongs to the pinned
upstream version recorded in tpusync_operator.versions (read from the upstream file cited
there), for every sample and every engine option. The vLLM command lines are also parsed by
vLLM itself in tests/vllm/test_rendered_args.py, and the reference engine's here by its own
parser."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml
from op_helpers import PoolBody, ServingBody

from tpusync_operator import versions
from tpusync_operator.builders import engine, llmd, sglang_pd
from tpusync_operator.builders.common import Owner, pod_templates
from tpusync_operator.builders.engine import vllm_argv
from tpusync_operator.builders.serving import PoolInfo
from tpusync_operator.models import DisaggregatedServingSpec, TPUSyncPoolSpec
from tpusync_operator.render import load, render
from tpusync_operator.serving_plan import OPTIONAL_KINDS, plan_serving
from tpusync_operator.tpu import slice_for

SAMPLES = sorted((Path(__file__).resolve().parents[3] / "samples").glob("*.yaml"))


def pool_info(body):
    spec = TPUSyncPoolSpec.model_validate(body["spec"])
    return PoolInfo(body["metadata"]["name"], spec, slice_for(spec.tpu.type, spec.tpu.topology))


# Every engine option that changes a command line: engine and connector, routing (precise,
# approximate, off), model source (hf, hf with revision and token, gs, path).
ENGINES = [({"type": "reference"}, {"connector": "tpusync"}),
           ({"type": "vllm-tpu"}, {"connector": "tpusync"}),
           ({"type": "vllm-tpu"}, {"connector": "tpu-inference"}),
           ({"type": "vllm-tpu"}, {"connector": "tpu-sync-compatible"}),
           ({"type": "sglang-jax", "image": "registry.example/sgl:main"}, {"connector": "sglang-jax"})]
ROUTING = [{"enabled": True, "precisePrefixCache": True}, {"enabled": True, "precisePrefixCache": False},
           {"enabled": False}]
MODELS = [{"name": "m", "uri": "hf://org/m"},
          {"name": "m", "uri": "hf://org/m", "revision": "v1", "tokenSecretRef": {"name": "hf"}},
          {"name": "m", "uri": "gs://bucket/models/m"},
          {"name": "m", "uri": "/models/m"}]


def matrix():
    """(id, plan.apply) for every valid combination, on a v6e and a v7x multi-host pool."""
    pools = {"v6e": PoolBody(), "v7x": PoolBody().v7x("2x2x2").gke(workloadPolicy="wp")}
    for (eng, kv), routing, model, (pname, pool) in itertools.product(ENGINES, ROUTING, MODELS, pools.items()):
        if eng["type"] == "sglang-jax" and routing.get("precisePrefixCache"):
            continue   # the schema refuses it: sglang-jax publishes no KV events
        if model["uri"].startswith("gs://") and eng["type"] != "vllm-tpu":
            continue   # the schema refuses it: only vLLM streams from gs://
        if "revision" in model and eng["type"] == "reference":
            continue   # the schema refuses it: the reference engine's model is built in
        if eng["type"] == "sglang-jax" and pname == "v7x":
            continue   # the planner refuses it: sglang-jax runs on single-host slices only
        body = ServingBody().spec(engine=eng, kvTransfer=kv, routing=routing,
                                  model=model).build()
        spec = DisaggregatedServingSpec.model_validate(body["spec"])
        ident = f"{eng['type']}-{kv['connector']}-{routing}-{model['uri']}-{pname}"
        yield ident, plan_serving(Owner.from_body(body), spec, pool_info(pool.build()), set(OPTIONAL_KINDS)).apply
    for eng, kv in ENGINES:      # Lockstep: the roles inside a DisaggregatedSet, the rollout screener
        body = ServingBody().spec(engine=eng, kvTransfer=kv, rollout={"strategy": "Lockstep"},
                                  routing={"precisePrefixCache": eng["type"] != "sglang-jax"}).build()
        spec = DisaggregatedServingSpec.model_validate(body["spec"])
        yield f"{eng['type']}-{kv['connector']}-lockstep", plan_serving(
            Owner.from_body(body), spec, pool_info(PoolBody().build()), set(OPTIONAL_KINDS)).apply
    docs = load([str(p) for p in SAMPLES])
    yield "samples", [r.body for r in render(docs) if "kind" in r.body]   # not the node pool requests


CASES = list(matrix())


def containers(objs):
    for o in objs:
        for _, t in pod_templates(o):
            yield from t["spec"].get("initContainers", [])
            yield from t["spec"]["containers"]


def long_options(args):
    """The long options of a command line ('--x=1' and '--x 1' alike)."""
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def pin_of(container) -> versions.Pin | None:
    image, command = container["image"], container.get("command", [])
    if container["name"] == "epp":
        return versions.EPP
    if container["name"] == "routing-proxy":
        return versions.ROUTING_PROXY
    if vllm_argv(container) is not None:
        return versions.VLLM
    if command == ["sh", "-c", engine.RAY_WORKER_SCRIPT]:
        return versions.RAY
    if command[-1:] == ["sgl_jax.launch_server"]:
        return versions.SGLANG_JAX
    if command[-1:] == ["sgl_jax.srt.disaggregation.run_bootstrap"]:
        return versions.SGLANG_JAX_BOOTSTRAP
    assert image.startswith("ghcr.io/tpusync/"), image   # ours: tested against our own parsers
    return None


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_rendered_flag_is_in_the_pinned_versions_flag_set(case):
    ident, objs = case
    pinned = [(c, pin_of(c)) for c in containers(objs)]
    for c, pin in pinned:
        if pin is None:
            continue
        args = vllm_argv(c) if pin is versions.VLLM else c.get("args", [])
        unknown = long_options(args) - pin.flags
        assert not unknown, (f"{c['name']}: {sorted(unknown)} not flags of {pin.name} {pin.version} "
                             f"({pin.flags_source.cite()})")
    checked = {pin.name for _, pin in pinned if pin is not None}
    if ident.startswith("vllm-tpu"):
        assert versions.VLLM.name in checked
    if "'enabled': True" in ident:
        assert versions.EPP.name in checked and versions.ROUTING_PROXY.name in checked


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plugins_connectors_images_and_apis_are_the_pinned_ones(case):
    _, objs = case
    for o in objs:
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-epp"):
            config = yaml.safe_load(o["data"][llmd.EPP_CONFIG_KEY])
            assert config["apiVersion"] in versions.EPP.values["config_api"]
            types = {p["type"] for p in config["plugins"]}
            assert types <= versions.EPP.values["plugins"], types - versions.EPP.values["plugins"]
        if o["kind"] == "InferencePool":
            assert o["apiVersion"] in versions.GATEWAY_API_INFERENCE_EXTENSION.values["apis"]
        if o["kind"] == "InferenceObjective":
            assert o["apiVersion"] in versions.INFERENCE_OBJECTIVE.values["apis"]
        if o["kind"] in versions.GKE_GATEWAY_POLICIES.values["kinds"]:
            assert o["apiVersion"] in versions.GKE_GATEWAY_POLICIES.values["apis"]
        if o["kind"] in ("LeaderWorkerSet", "DisaggregatedSet"):
            assert o["apiVersion"] in versions.LWS.values["apis"]
    for c in containers(objs):
        if c["name"] == "routing-proxy":
            assert c["image"] == versions.ROUTING_PROXY.image
            connector = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--kv-connector="))
            assert connector in versions.ROUTING_PROXY.values["kv_connectors"]
        if c["name"] == "epp":
            assert c["image"] == versions.EPP.image
        if c["name"] == "tpusync-sidecar":
            assert c["image"] == versions.SIDECAR_IMAGE


def test_every_plugin_type_cites_its_source():
    assert set(versions.EPP_PLUGIN_SOURCES) == versions.EPP.values["plugins"]


def test_every_pin_cites_an_upstream_source():
    for pin in versions.ALL:
        assert pin.proof or pin.flags_source, pin.name
        if pin.flags:
            assert pin.flags_source is not None, pin.name
            assert all(f.startswith("--") and " " not in f for f in pin.flags), pin.name
    rows = versions.table()
    assert len(rows) == len(versions.ALL) and all(r[3] for r in rows)


def test_old_pins_would_fail():
    """The findings of issue 11, as checks: the old images and flags are not the pinned ones."""
    assert versions.EPP.image != "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.5.0"
    assert versions.ROUTING_PROXY.image.startswith("ghcr.io/llm-d/llm-d-router-disagg-sidecar:")
    # --model-server-port is a flag of the pinned proxy (v0.5.0's only had --vllm-port).
    assert "--model-server-port" in versions.ROUTING_PROXY.flags


def test_vllm_decode_serves_render_only_when_the_token_producer_asks():
    def args(routing):
        body = ServingBody().spec(engine={"type": "vllm-tpu"}, routing=routing).build()
        objs = plan_serving(Owner.from_body(body), DisaggregatedServingSpec.model_validate(body["spec"]),
                            pool_info(PoolBody().build()), set(OPTIONAL_KINDS)).apply
        return {o["metadata"]["name"]: c["args"] for o in objs for c in containers([o]) if c["name"] == "engine"}
    precise = args({"precisePrefixCache": True})
    assert versions.VLLM_RENDER_FLAG in precise["llm-decode"]
    assert versions.VLLM_RENDER_FLAG not in precise["llm-prefill"]
    assert all(versions.VLLM_RENDER_FLAG not in a for a in args({"precisePrefixCache": False}).values())
    assert all(versions.VLLM_RENDER_FLAG not in a for a in args({"enabled": False}).values())


def test_reference_engine_args_parse_with_its_own_parser():
    """As the kubelet starts them: $(VAR) expanded over what the pod has (LWS injects its
    variables into multi-host groups)."""
    from harness.kube_expansion import command_line
    from tpusync.engines.reference.__main__ import parse_args
    env = {"POD_IP": "10.0.0.2", "LWS_LEADER_ADDRESS": "llm-decode-0.llm-decode", "LWS_WORKER_INDEX": "1"}
    parsed = 0
    for _, objs in CASES:
        for c in containers(objs):
            if c.get("command") == ["python", "-m", "tpusync.serving"]:
                ns = parse_args(command_line(c, env)[3:])
                assert ns.role in ("prefill", "decode") and ns.port > 0
                parsed += 1
    assert parsed


def test_sglang_bootstrap_and_engine_agree_on_ports():
    owner = Owner("tpusync.dev/v1alpha1", "DisaggregatedServing", "s", "ns", "u")
    args = sglang_pd.engine_args(owner, "prefill")
    assert long_options(args) <= versions.SGLANG_JAX.flags
    assert str(sglang_pd.BOOTSTRAP_PORT) in sglang_pd.bootstrap_url(owner)


def test_the_guides_version_table_matches_versions_py():
    rows = [line for line in (SAMPLES[0].parents[1] / "docs" / "gke.md").read_text().splitlines()
            if line.startswith("| ")]
    for pin in versions.ALL:
        if pin is versions.SGLANG_JAX_BOOTSTRAP:
            continue
        row = next((r for r in rows if r.startswith(f"| {pin.name} | {pin.version} |")), None)
        assert row is not None, f"docs/gke.md has no row for {pin.name} {pin.version}"
        for image in ([pin.image] if pin.image else sorted(pin.values.get("images", ()))):
            assert image in row, (pin.name, image)


def test_rendered_sidecar_args_parse_with_the_sidecar_itself():
    """tpusync-sidecar parses and checks every flag before it looks at --help: the rendered
    command lines of every case (serving pods and store nodes) must pass it."""
    import subprocess

    from tpusync.local.sidecars import sidecar_binary
    binary = sidecar_binary()
    seen = set()
    for _, objs in CASES:
        for c in containers(objs):
            if c["name"] == "tpusync-sidecar" and tuple(c["args"]) not in seen:
                seen.add(tuple(c["args"]))
    assert len(seen) > 2
    for args in sorted(seen):
        res = subprocess.run([binary, *args, "--help"], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, (args, res.stderr)
    # the check can fail: a misspelled flag is refused
    res = subprocess.run([binary, *sorted(seen)[0], "--dram-byte=1Gi", "--help"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 2 and "unknown flag --dram-byte" in res.stderr


def test_ray_start_options_are_the_pinned_rays():
    for args in (engine.RAY_HEAD_ARGS, engine.RAY_WORKER_ARGS):
        assert long_options(args) <= versions.RAY.flags, long_options(args) - versions.RAY.flags
    assert "ray start " + " ".join(engine.RAY_HEAD_ARGS) in engine.RAY_LEADER_SCRIPT
    assert "exec ray start " + " ".join(engine.RAY_WORKER_ARGS) in engine.RAY_WORKER_SCRIPT


def test_the_e2e_control_plane_installs_the_versions_the_operator_names():
    """e2e installs CRDs from the module versions in e2e/versions.env: they must be the ones the
    version table pins, or the e2e tier checks the operator against other schemas."""
    env_file = Path(__file__).resolve().parents[3] / "e2e" / "versions.env"
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["GATEWAY_API_INFERENCE_EXTENSION_VERSION"] == versions.GATEWAY_API_INFERENCE_EXTENSION.version
    assert env["LWS_VERSION"] == versions.LWS.version


def _gke_backend_pools(objs):
    """InferencePools that a GKE GCPBackendPolicy targets: their Gateway is GKE's."""
    return {o["spec"]["targetRef"]["name"] for o in objs if o["kind"] == "GCPBackendPolicy"
            and o["spec"]["targetRef"]["kind"] == "InferencePool"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_http_routes_carry_only_what_upstream_renders_for_their_gateway(case):
    """Upstream's charts render an HTTPRoute rule's timeouts.request except on GKE, whose Gateway
    controller does not admit it; there the GCPBackendPolicy carries the timeout (timeoutSec)."""
    _, objs = case
    gke = _gke_backend_pools(objs)
    pin = versions.GKE_GATEWAY_POLICIES
    for o in objs:
        if o["kind"] != "HTTPRoute":
            continue
        pools = {b["name"] for r in o["spec"]["rules"] for b in r["backendRefs"] if b["kind"] == "InferencePool"}
        on_gke = bool(pools & gke)
        allowed = pin.values["httproute_rule_fields_gke" if on_gke else "httproute_rule_fields"]
        for rule in o["spec"]["rules"]:
            assert set(rule) <= allowed, (o["metadata"]["name"], sorted(set(rule) - allowed))
    for o in objs:
        if o["kind"] == "GCPBackendPolicy":
            assert o["spec"]["default"]["timeoutSec"] == versions.GKE_BACKEND_TIMEOUT_SEC


def test_the_samples_route_through_gkes_gateway():
    """The check above sees a GKE route: the v7x sample's."""
    _, objs = CASES[-1]
    assert _gke_backend_pools(objs) and any(o["kind"] == "HTTPRoute" for o in objs)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_epp_service_and_config_use_the_pinned_routers_names(case):
    """The ext-proc port's appProtocol is the one the pinned router's chart declares, and the
    token processor's fields are the pinned router's current ones (not the deprecated blockSize)."""
    _, objs = case
    for o in objs:
        if o["kind"] == "Service" and o["metadata"]["name"].endswith("-epp"):
            port = next(p for p in o["spec"]["ports"] if p["name"] == "grpc-ext-proc")
            assert port.get("appProtocol") in versions.EPP.values["ext_proc_app_protocol"], port
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-epp"):
            config = yaml.safe_load(o["data"][llmd.EPP_CONFIG_KEY])
            for p in config["plugins"]:
                tp = p.get("parameters", {}).get("tokenProcessorConfig")
                if tp is not None:
                    assert set(tp) <= versions.EPP.values["token_processor_fields"], sorted(tp)


def test_every_epp_config_fact_cites_its_source():
    assert {"token_processor_fields", "ext_proc_app_protocol"} <= set(versions.EPP.values)
    assert set(versions.EPP_CONFIG_SOURCES) == {"token_processor_fields", "ext_proc_app_protocol"}
