"""Real processes: two sidecars, a prefill server, a decode server and a monolithic server.

The central correctness test: disaggregated and prefix-cached runs produce exactly the
tokens of the monolithic run.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.integration.serving.requests import pd, post, prompt, tokens
from tests.integration.serving.stack import ServingStack
from tpusync.engines.reference import codec
from tpusync.engines.reference.model import ModelConfig
from tpusync.local import sidecars as sidecar
from tpusync.local.servers import start_server

MODEL = {"max_seq": 1024, "layers": 2, "d_model": 128, "mlp": 256}
CFG = ModelConfig(**MODEL)
MODEL16 = {**MODEL, "page_size": 16}
BLOCK = -(-CFG.page_bytes // 4096) * 4096


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    stack = ServingStack(tmp_path_factory.mktemp("pd"), BLOCK)
    try:
        p_side, d_side = stack.sidecar("p_side"), stack.sidecar("d_side")
        stack.add("mono", start_server("both", model_config=MODEL, prefix_cache=False))
        stack.add("prefill", start_server("prefill", model_config=MODEL, control_socket=p_side.control_socket,
                                          data_address=p_side.address))
        stack.add("decode", start_server("decode", model_config=MODEL, control_socket=d_side.control_socket,
                                         data_address=d_side.address, peers=[p_side.address]))
        # Engines of 16-token pages, each on a sidecar of its own: the prefill of the 32-token
        # decode engine above, and a decode engine of the 32-token prefill.
        p16, d16 = stack.sidecar("p16_side"), stack.sidecar("d16_side")
        stack.add("prefill16", start_server("prefill", model_config=MODEL16, control_socket=p16.control_socket,
                                            data_address=p16.address))
        stack.add("decode16", start_server("decode", model_config=MODEL16, control_socket=d16.control_socket,
                                           data_address=d16.address))
        yield stack.running
    finally:
        stack.close()


def test_disaggregated_and_cached_runs_match_the_monolithic_run(cluster):
    shared = prompt(0, 400)
    for i in range(3):
        p = shared + prompt(100 + i, 150)
        want, first, decoded = pd(cluster["mono"].url, cluster["prefill"].url, cluster["decode"].url, p, 12)
        assert tokens(first) == want[:1]
        params = first["kv_transfer_params"]
        assert f'{params["remote_host"]}:{params["remote_port"]}' == cluster["p_side"].address
        assert tokens(decoded) == want
        stats = decoded["tpusync"]
        full_pages = len(p) // CFG.page_size
        # Only the blocks the decode host lacked travelled: the shared prefix came once.
        expected_pulled = full_pages if i == 0 else full_pages - len(shared) // CFG.page_size
        assert stats["pulled_blocks"] == expected_pulled
        assert stats["computed_tokens"] < CFG.chunk + CFG.page_size
        hit = post(cluster["decode"].url, {"prompt": p, "max_tokens": 12})
        assert tokens(hit) == want and hit["tpusync"]["pulled_blocks"] == 0


def test_decode_finds_a_prefix_on_a_peer_without_transfer_params(cluster):
    p = prompt(7, 300)
    want = tokens(post(cluster["mono"].url, {"prompt": p, "max_tokens": 6}))
    post(cluster["prefill"].url, {"prompt": p, "max_tokens": 1})  # now in the prefill host's sidecar
    r = post(cluster["decode"].url, {"prompt": p + prompt(8, 40), "max_tokens": 6})
    assert r["tpusync"]["pulled_blocks"] == 300 // CFG.page_size
    assert tokens(post(cluster["decode"].url, {"prompt": p, "max_tokens": 6})) == want


def test_metrics_and_errors(cluster):
    text = urllib.request.urlopen(cluster["decode"].url + "/metrics").read().decode()
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert gauge in text
    assert urllib.request.urlopen(cluster["decode"].url + "/health").status == 200
    for body, message in (({"prompt": "x", "temperature": 0.7}, "greedily"), ({"prompt": {"a": 1}}, "prompt"),
                          ({"prompt": "x", "max_tokens": 0}, "max_tokens")):
        with pytest.raises(urllib.error.HTTPError) as e:
            post(cluster["mono"].url, body)
        assert e.value.code == 400 and message in json.load(e.value)["error"]["message"]


def kv_path(url: str) -> dict[str, float]:
    """The engine's KV-path counters from its /metrics, parsed by Prometheus' own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return {s.name + (f"/{s.labels['reason']}" if "reason" in s.labels else ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("tpusync_kv_")}


def test_the_kv_path_counts_what_a_hand_off_did(cluster):
    """What the operator reads to tell whether P/D really works (tpusync.kv.path_metrics)."""
    before = {role: kv_path(cluster[role].url) for role in ("prefill", "decode")}
    p = prompt(21, 200)
    pd(cluster["mono"].url, cluster["prefill"].url, cluster["decode"].url, p, 4)
    after = {role: kv_path(cluster[role].url) for role in ("prefill", "decode")}
    delta = {role: {k: after[role][k] - before[role].get(k, 0) for k in after[role]} for role in after}
    pages = len(p) // CFG.page_size
    assert delta["decode"]["tpusync_kv_requests_total"] == 1 and delta["decode"]["tpusync_kv_handoffs_total"] == 1
    assert delta["decode"]["tpusync_kv_pulled_blocks_total"] == pages
    assert delta["decode"]["tpusync_kv_loaded_blocks_total"] == pages
    assert delta["decode"]["tpusync_kv_refused_handoffs_total"] == 0
    assert delta["decode"]["tpusync_kv_pull_failures_total"] == 0
    assert delta["prefill"]["tpusync_kv_saved_blocks_total"] == pages
    assert delta["prefill"]["tpusync_kv_handoffs_total"] == 0
    assert after["decode"]["tpusync_kv_connector_off/unsupported-config"] == 0
    # A hand-off naming a prefill that keyed the prompt otherwise is refused, counted, recomputed.
    first = post(cluster["prefill"].url, {"prompt": p, "max_tokens": 1})
    params = {**first["kv_transfer_params"], "tpusync_last_key": "0" * 32}
    post(cluster["decode"].url, {"prompt": p + prompt(22, 10), "max_tokens": 2, "kv_transfer_params": params})
    assert kv_path(cluster["decode"].url)["tpusync_kv_refused_handoffs_total"] == \
        after["decode"]["tpusync_kv_refused_handoffs_total"] + 1


def test_text_prompts_round_trip(cluster):
    r = post(cluster["mono"].url, {"prompt": "The quick brown fox", "max_tokens": 5})
    assert r["usage"] == {"prompt_tokens": 19, "completion_tokens": 5, "total_tokens": 24}
    assert len(r["choices"][0]["text"]) == 5


def test_render_gives_the_tokens_the_engine_hashes(cluster):
    """llm-d's token-producer tokenizes through /v1/completions/render; the ids must be the
    ones the engine computes block keys (and KV events) from."""
    def render(body):
        return post(cluster["decode"].url, body, "/v1/completions/render")
    assert render({"prompt": "The quick brown fox"}) == [{"token_ids": codec.encode("The quick brown fox")}]
    assert render({"prompt": ["ab", [7, 8, 9]]}) == [{"token_ids": [97, 98]}, {"token_ids": [7, 8, 9]}]
    assert render({"prompt": [5, 6]}) == [{"token_ids": [5, 6]}]
    with pytest.raises(urllib.error.HTTPError) as e:
        render({"prompt": {"a": 1}})
    assert e.value.code == 400


def test_dead_prefill_sidecar_means_recompute_not_wrong_tokens(cluster):
    p = prompt(11, 350)
    want = tokens(post(cluster["mono"].url, {"prompt": p, "max_tokens": 8}))
    params = post(cluster["prefill"].url, {"prompt": p, "max_tokens": 1})["kv_transfer_params"]
    params["remote_host"], params["remote_port"] = "127.0.0.1", 1  # the prefill host's sidecar is gone
    r = post(cluster["decode"].url, {"prompt": p, "max_tokens": 8, "kv_transfer_params": params})
    assert tokens(r) == want
    assert r["tpusync"]["prefix_cache"] == "unavailable"  # and why stays in the server's log
    assert "127.0.0.1:1" not in json.dumps(r)


def test_a_restarted_sidecar_is_used_again_with_what_its_pool_kept(cluster):
    """The prefill pod's sidecar restarts (its shared-memory pool survives): the server's next
    request reconnects and loads the prefix it had saved, no request lost to the restart."""
    p = prompt(12, 300)
    want = tokens(post(cluster["mono"].url, {"prompt": p, "max_tokens": 1}))
    post(cluster["prefill"].url, {"prompt": p, "max_tokens": 1})
    old = cluster["p_side"]
    old.stop()
    cluster["p_side"] = sidecar.relaunch(old)
    r = post(cluster["prefill"].url, {"prompt": p, "max_tokens": 1})
    assert tokens(r) == want
    assert r["tpusync"]["prefix_cache"] == "ok" and r["tpusync"]["cached_tokens"] == 256


@pytest.mark.parametrize(("prefill", "decode", "pulled"), [("prefill16", "decode", 21), ("prefill", "decode16", 10)])
def test_pd_between_engines_of_another_page_size_regroups_on_load(cluster, prefill, decode, pulled):
    """Pages of 16 tokens to pages of 32 (each page from two of the prefill's blocks) and back
    (each page from half a block): the decode engine keys the prompt at the prefill's page size,
    pulls those blocks and fills its pages with their token ranges; the monolithic tokens."""
    p = prompt(13 if prefill == "prefill16" else 14, 350)
    want, _, decoded = pd(cluster["mono"].url, cluster[prefill].url, cluster[decode].url, p, 8)
    assert tokens(decoded) == want
    st = decoded["tpusync"]
    assert st["prefix_cache"] == "ok" and st["pulled_blocks"] == pulled and st["cached_tokens"] == 256
