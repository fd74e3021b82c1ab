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

from tests.support.engines import prompt

PROMPT = prompt(11, 200)  # 6 full blocks pulled, 8 tokens computed on the decode engine


def _prefill(engines, p: list[int]) -> dict:
    out = engines["prefill"].generate(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = out["kv_transfer_params"]
    assert params["remote_block_ids"] and params["remote_host"] == "127.0.0.1"
    return params


def _pulled_and_inserted(engine) -> bool:
    """The decode engine's log says the pull succeeded and the KV went into its cache (so wrong
    tokens come from when it went in, not from a failed pull)."""
    log = engine.log_path.read_text(errors="replace")
    return "kv transfer | done pull" in log and "for insert_kv_chunks" in log


def test_shipped_connector_decodes_wrong_tokens(engines, reference):
    params = _prefill(engines, PROMPT)
    out = engines["decode"].generate(PROMPT, max_tokens=16, kv_transfer_params=params)
    assert _pulled_and_inserted(engines["decode"])
    assert out["token_ids"] != reference(PROMPT), "upstream fixed the load ordering: update this test and the operator"


def test_sync_load_flag_fixes_it(engines, reference):
    params = _prefill(engines, PROMPT)
    out = engines["decode-fixed"].generate(PROMPT, max_tokens=16, kv_transfer_params=params)
    assert _pulled_and_inserted(engines["decode-fixed"])
    assert out["token_ids"] == reference(PROMPT)
