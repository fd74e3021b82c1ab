"""tpu-inference's own Raiden P/D connector (tpu_inference/distributed/tpu_raiden_connector.py,
TPUConnector, as shipped in 0.32.0), unmodified, on tpusync, configured as the operator renders
connector tpu-sync-compatible: the --kv-transfer-config (which vLLM's own parser takes when the
engines start) and the environment: TPUSYNC_UPSTREAM_API=1, so the connector's
`tpu_raiden.api.jax.kv_cache_manager` import resolves to tpusync.engines.upstream, and
TPU_KV_TRANSFER_PORT (the port the prefill engine advertises) is its sidecar's data port. The
decode engine pulls the prompt's blocks from the prefill pod's sidecar into its own and gives
the tokens HF transformers gives.
"""

from __future__ import annotations

import pytest

from harness.engines import EngineSpec, delta, prompt

MODULE = "tpu_inference.distributed.tpu_raiden_connector"


@pytest.fixture(scope="module")
def pd(model_dir, tmp_path_factory):
    """Sidecars p and d; a prefill engine (kv_producer) on p and a decode engine (kv_consumer) on d."""
    from harness.tinymodel import BLOCK_BYTES
    from harness.tpu_engines import Pods, TpuEngine, rendered_kv_transfer_config
    from tpusync_operator.builders.engine import upstream_api_env

    pods = Pods(tmp_path_factory.mktemp("upstream-pd"), "upstream-pd")
    try:
        engines = {}
        for name, role in (("p", "prefill"), ("d", "decode")):
            car = pods.sidecar(name, dram_bytes=16 << 20, block_bytes=BLOCK_BYTES)
            kv = rendered_kv_transfer_config("tpu-sync-compatible", role, data_address=car.address)
            assert kv["kv_connector_module_path"] == MODULE
            port = int(car.address.rsplit(":", 1)[1])
            env = {e["name"]: e["value"].replace("$(POD_IP)", "127.0.0.1") for e in upstream_api_env(port)}
            engines[name] = TpuEngine(f"upstream-{role}", EngineSpec(str(model_dir), pods.work, kv), env=env | {
                "TPUSYNC_CONTROL_SOCKET": car.control_socket, "TPU_P2P_WAIT_PULL_TIMEOUT": "30"})
        pods.start(**engines)
        yield pods.engines, pods.sidecars
    finally:
        pods.close()


def prefill(engines, p: list[int]) -> dict:
    params = engines["p"].generate(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
        "kv_transfer_params"]
    assert params["remote_block_ids"] and params["remote_host"] == "127.0.0.1"
    return params


def test_decode_pulls_the_prefill_pods_blocks_through_the_sidecars(pd, reference):
    engines, _ = pd
    p = prompt(61, 200)  # 6 full blocks pulled, 8 tokens computed on the decode engine
    params = prefill(engines, p)
    assert len(params["remote_block_ids"]) == 6
    assert engines["p"].stats()["upstream_registered_blocks"] == 6
    before = engines["d"].stats()
    assert engines["d"].generate(p, max_tokens=16, kv_transfer_params=params)["token_ids"] == reference(p)
    d = delta(engines["d"].stats(), before)
    assert d["upstream_pulled_blocks"] == 6 and d["upstream_failed_pulls"] == 0
    q = prompt(62, 100)  # the prefill engine's next step sees the ack and lets the blocks go
    engines["p"].generate(q, max_tokens=1)
    assert engines["p"].stats()["upstream_acked_sends"] == 1
