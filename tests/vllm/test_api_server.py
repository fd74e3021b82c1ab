"""The deployed form: vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`,
the engine core in a process of its own, as `vllm serve` runs it), with kv_transfer_params in the
HTTP request and response bodies as llm-d's routing sidecar passes them between P and D."""

from __future__ import annotations

from harness.engines import delta, prompt
from harness.tinymodel import BLOCK_SIZE

HITS = "vllm:external_prefix_cache_hits_total"  # prompt tokens a KV connector supplied
KV_PATH = ("requests", "handoffs", "refused_handoffs", "pulled_blocks", "pull_failures", "loaded_blocks",
           "recomputed_blocks")


def test_the_server_as_prefill_returns_params_a_decode_engine_pulls_with(cluster):
    p = prompt(30, 300)
    resp = cluster.api.complete(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = resp["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", cluster.q.data_port)
    assert params["remote_num_tokens"] == 9 * BLOCK_SIZE
    before = cluster.decode.stats()
    out = cluster.decode.generate(p, kv_transfer_params=params)
    assert delta(cluster.decode.stats(), before)["pulled_blocks"] == 9
    assert out["token_ids"] == cluster.reference(p)


def test_the_server_as_decode_pulls_from_the_prefill_engine(cluster):
    p = prompt(31, 300)
    params = cluster.prefill.generate(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    hits = cluster.api.metric(HITS)
    path = {name: cluster.api.metric(f"tpusync_kv_{name}_total") for name in KV_PATH}
    resp = cluster.api.complete(p, max_tokens=16, kv_transfer_params=params["kv_transfer_params"])
    assert resp["choices"][0]["token_ids"] == cluster.reference(p)
    # The connector's counters are in the server's engine process; vLLM's metrics show the hit,
    # and the KV path's counters the operator reads (tpusync.kv.path_metrics, through the
    # connector's build_prom_metrics): one hand-off, its 9 blocks pulled and loaded.
    assert cluster.api.metric(HITS) - hits == 9 * BLOCK_SIZE
    gained = {name: cluster.api.metric(f"tpusync_kv_{name}_total") - path[name] for name in KV_PATH}
    assert gained == {"requests": 1, "handoffs": 1, "refused_handoffs": 0, "pulled_blocks": 9, "pull_failures": 0,
                      "loaded_blocks": 9, "recomputed_blocks": 0}, gained
    assert cluster.api.metric("tpusync_kv_connector_off") == 0
