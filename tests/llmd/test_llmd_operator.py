"""What the operator renders for llm-d (the EPP's precise-prefix-cache-producer parameters, the
InferencePool) against the engines it deploys, for the reference-engine sample: the values
that must agree (docs/block-keys.md) do, in llm-d's own indexer where it can run here.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from harness.llmd_fleet import connect, eventually, served
from tpusync.engines.reference.__main__ import parse_args
from tpusync.engines.reference.model import ModelConfig
from tpusync.kv.keys import BlockHasher
from tpusync.store import KVStore
from tpusync_operator.builders import llmd
from tpusync_operator.builders.common import Owner
from tpusync_operator.builders.engine import engine_command
from tpusync_operator.builders.serving import engine_port
from tpusync_operator.models import DisaggregatedServingSpec

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "v6e-single-host-reference.yaml"
ROLES = ("prefill", "decode")


def rendered():
    serving = next(d for d in yaml.safe_load_all(SAMPLE.read_text()) if d["kind"] == "DisaggregatedServing")
    serving["metadata"]["uid"] = "00000000-0000-0000-0000-000000000001"  # set by the API server
    owner, spec = Owner.from_body(serving), DisaggregatedServingSpec.model_validate(serving["spec"])
    epp = llmd.build_epp_config(owner, spec, 5557)
    params = next(p for p in epp["plugins"] if p["type"] == "precise-prefix-cache-producer")["parameters"]
    engines = {}
    for role in ROLES:
        _, args = engine_command(owner, spec, role, port=engine_port(spec, role), tensor_parallel=1,
                                 data_port=9400, kv_events_port=5557)
        engines[role] = parse_args([a.replace("$(POD_IP)", "10.0.0.1") for a in args])
    return spec, params, engines, llmd.build_inference_pool(owner, spec)


def llmd_block(params: dict) -> int:
    tp = params.get("tokenProcessorConfig") or {}
    return tp.get("blockSizeTokens") or tp.get("blockSize") or 16  # llm-d's precedence and default


def test_llmd_block_size_divides_every_engines_page_size():
    _, params, engines, _ = rendered()
    for role, args in engines.items():
        page = ModelConfig(**json.loads(args.model_config)).page_size
        assert page % llmd_block(params) == 0, (role, page, llmd_block(params))


def test_the_tiers_engines_announce_are_weighed():
    _, params, _, _ = rendered()
    weights = {b["name"]: b["weight"] for b in params["indexerConfig"].get("kvCacheBackendConfigs", [])}
    # Unlisted tiers weigh 1.0 in llm-d: a block on disk would outrank one in DRAM.
    assert {"cpu", "disk"} <= set(weights) and weights["cpu"] > weights["disk"], weights


def test_the_topic_names_the_endpoint_the_router_scores():
    _, _, engines, pool = rendered()
    ports = {p["number"] for p in pool["spec"]["targetPorts"]}
    for role, args in engines.items():
        topic_port = args.kv_events_topic.split("@")[1].rsplit(":", 1)[1] if args.kv_events_topic else args.port
        assert int(topic_port) in ports, (role, topic_port, ports)


def test_a_demoted_prefix_stays_indexed_with_the_operators_parameters(cluster):
    """llm-d's indexer configured by the operator, an engine with the operator's page size: a
    prefix the sidecar writes to disk is still this pod's, on disk."""
    _, params, engines, _ = rendered()
    page = ModelConfig(**json.loads(engines["decode"].model_config)).page_size
    local = {**params, "kvEventsConfig": {**params["kvEventsConfig"], "discoverPods": False}}
    ix = cluster.indexer(local)
    host = cluster.host(page, disk=True)
    engine = cluster.engine(host, page, extra=["--kv-events-audit-s", "0.2"])
    connect(ix, engine, list(range(64)))
    prompt = [(7 * i) % 256 for i in range(3 * page + 5)]
    served(ix, engine, prompt)
    want = 3 * page // ix.block_size
    assert ix.score(prompt)["pods"][engine.pod]["matchedBlocks"] == want
    with KVStore.connect(f"unix://{host.sidecar.control_socket}") as store:
        store.evict(BlockHasher(page).keys(prompt))

    def on_disk():
        got = ix.score(prompt)["pods"].get(engine.pod)
        return got if got and got["tiers"] == {"disk": want} else None
    got = eventually(on_disk)
    assert got and got["matchedBlocks"] == want, ix.score(prompt)
