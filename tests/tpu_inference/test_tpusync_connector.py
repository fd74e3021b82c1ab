"""tpusync's connector for tpu-inference (`tpusync.tpu_inference.connector`) in real engines on
real sidecars, configured with the --kv-transfer-config the operator renders for a vllm-tpu
serving (connector tpusync): a prefill/decode pair in two processes, the decode engine pulling
from the prefill pod's sidecar; a fresh engine served from the sidecar's DRAM tier. Tokens
equal HF transformers'; the pool's blocks equal the engine's pages."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
from harness import delta, prompt

SECRET = b"tpu-inference-tier-secret-0123456789"
PROMPT = prompt(21, 300)  # 9 full blocks and 12 tokens


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """Sidecars p (prefill pod) and d (decode pod); engines prefill (kv_producer on p),
    decode (kv_consumer on d), fresh (kv_both on p, started after prefill saved)."""
    from tinymodel import BLOCK_BYTES
    from tpu_harness import EngineSpec, TpuEngine, rendered_kv_transfer_config

    from tpusync import sidecar as sidecar_mod

    work = tmp_path_factory.mktemp("tpusync-connector")
    secret = work / "secret"
    secret.write_bytes(SECRET + b"\n")
    sidecars, pools, engines = {}, [], {}

    def connector(role: str, sidecar, kv_role: str | None = None):
        return EngineSpec(str(model_dir), work, rendered_kv_transfer_config(
            "tpusync", role, kv_role=kv_role, control_socket=sidecar.control_socket, data_address=sidecar.address))

    try:
        for name in ("p", "d"):
            pool = f"/dev/shm/tpusync-tpuinf-{os.getpid()}-{name}-{uuid.uuid4().hex[:6]}"
            pools.append(pool)
            sidecars[name] = sidecar_mod.launch(pool_path=pool, secret_file=str(secret), dram_bytes=32 << 20,
                                                block_bytes=BLOCK_BYTES, control_socket=str(work / f"{name}.sock"),
                                                stderr=subprocess.DEVNULL)
        engines["prefill"] = TpuEngine("tpusync-prefill", connector("prefill", sidecars["p"]))
        engines["decode"] = TpuEngine("tpusync-decode", connector("decode", sidecars["d"]))
        engines["fresh"] = TpuEngine("tpusync-fresh", connector("decode", sidecars["p"], kv_role="kv_both"))
        for e in engines.values():
            e.wait_ready()
        yield engines, sidecars
    finally:
        for e in engines.values():
            e.stop()
        for s in sidecars.values():
            if s.process.poll() is None:
                s.kill()
        for pool in pools:
            if os.path.exists(pool):
                os.unlink(pool)


def test_prefill_decode_pair_over_sidecars(cluster, reference):
    engines, _ = cluster
    before = engines["prefill"].stats()
    out = engines["prefill"].generate(PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert delta(engines["prefill"].stats(), before)["saved_blocks"] == 9
    params = out["kv_transfer_params"]
    assert params["remote_num_tokens"] == 288 and params["remote_port"]
    before = engines["decode"].stats()
    got = engines["decode"].generate(PROMPT, max_tokens=16, kv_transfer_params=params)
    d = delta(engines["decode"].stats(), before)
    assert d["pulled_blocks"] == 9 and d["loaded_blocks"] == 9 and d["load_error_blocks"] == 0
    assert got["token_ids"] == reference(PROMPT)


def test_fresh_engine_served_from_the_dram_tier(cluster, reference):
    engines, _ = cluster
    p = prompt(22, 200)  # 6 full blocks
    engines["prefill"].generate(p, max_tokens=1)
    before = engines["fresh"].stats()
    got = engines["fresh"].generate(p, max_tokens=16)
    d = delta(engines["fresh"].stats(), before)
    assert d["loaded_blocks"] == 6 and d["load_error_blocks"] == 0
    assert got["token_ids"] == reference(p)


def test_dead_prefill_peer_means_recompute(cluster, reference):
    import socket

    engines, _ = cluster
    p = prompt(23, 150)
    params = engines["prefill"].generate(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
        "kv_transfer_params"]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        params["remote_port"] = s.getsockname()[1]
    before = engines["decode"].stats()
    got = engines["decode"].generate(p, max_tokens=16, kv_transfer_params=params)
    d = delta(engines["decode"].stats(), before)
    assert d["peer_errors"] == 1 and d["pulled_blocks"] == 0 and d["loaded_blocks"] == 0
    assert got["token_ids"] == reference(p)


def test_params_from_an_engine_that_keyed_differently_mean_recompute(cluster, reference):
    engines, _ = cluster
    p = prompt(24, 150)
    params = engines["prefill"].generate(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
        "kv_transfer_params"]
    params["tpusync_last_key"] = f"{int(params['tpusync_last_key'], 16) ^ 1:032x}"  # another hash seed's key
    before = engines["decode"].stats()
    got = engines["decode"].generate(p, max_tokens=16, kv_transfer_params=params)
    d = delta(engines["decode"].stats(), before)
    assert d["pulled_blocks"] == 0 and d["loaded_blocks"] == 0
    assert got["token_ids"] == reference(p)
