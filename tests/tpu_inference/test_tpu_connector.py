"""tpu-inference's own TPUConnector, as shipped in 0.32.0, in a prefill/decode pair of engines
(two processes, KV pulled over JAX's transfer server).

Upstream defect (tpu-inference 0.32.0 under vLLM 0.32): the decode engine reports its pulls as
asynchronous and inserts the pulled KV inside `start_load_kv`, which vLLM 0.32 now runs after
the forward pass unless the scheduler output marks the step's loads synchronous
(`SchedulerOutput.has_sync_kv_loads`). The first forward of the request then reads KV pages
that are not filled yet, and the decode tokens are wrong. Setting the flag whenever the
connector has loads (tpusync.tpu_inference.upstream_fix) makes the tokens right. The operator's
`connector: tpu-inference` renders that fixed class.
"""

from __future__ import annotations

from harness.engines import prompt
from harness.tpu_engine_proc import BLOCK_SIZE

PROMPT = prompt(11, 200)  # 6 full blocks pulled, 8 tokens computed on the decode engine


def _prefill(engines, p: list[int]) -> tuple[dict, set[str]]:
    """The prefill's transfer params, and the digests of the pages it offers (read while it holds them)."""
    out = engines["prefill"].generate(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = out["kv_transfer_params"]
    assert params["remote_block_ids"] and params["remote_host"] == "127.0.0.1"
    params.pop("remote_prefill_cached_tokens", None)  # else vLLM reports the prefill's hits as the decode's
    pages = engines["prefill"].call("page_digests")["digests"][0]
    return params, {pages[b] for b in params["remote_block_ids"]}


def _decode(engine, p: list[int], params: dict, offered: set[str]) -> list[int]:
    """Decodes p from the prefill's blocks; checks vLLM took them as external hits and that the
    decode engine's cache holds those very pages afterwards (so a wrong token comes from when
    the KV went in, not from a failed pull)."""
    out = engine.generate(p, max_tokens=16, kv_transfer_params=params)
    assert out["num_cached_tokens"] == len(params["remote_block_ids"]) * BLOCK_SIZE
    assert offered <= set(engine.call("page_digests")["digests"][0])
    return out["token_ids"]


def test_shipped_connector_decodes_wrong_tokens(engines, reference):
    params, offered = _prefill(engines, PROMPT)
    tokens = _decode(engines["decode"], PROMPT, params, offered)
    assert tokens != reference(PROMPT), "upstream fixed the load ordering: update this test and the operator"


def test_sync_load_flag_fixes_it(engines, reference):
    params, offered = _prefill(engines, PROMPT)
    assert _decode(engines["decode-fixed"], PROMPT, params, offered) == reference(PROMPT)
