"""tpu-inference's own RaidenOffloadConnector (tpu_inference/offload/raiden_offload_connector.py,
as shipped in 0.32.0), unmodified, on tpusync: the engine runs with TPUSYNC_UPSTREAM_API=1, so
the connector's `tpu_raiden` imports resolve to tpusync.engines.upstream (its scheduler-side
KVCacheStore directory and its worker-side KVCacheManager, whose host pool is a real sidecar's
shared-memory pool). Tokens equal HF transformers' each time.
"""

from __future__ import annotations

import pytest

from harness.engines import EngineSpec, delta, prompt
from tpusync.store import KVStore

CONNECTOR = {"kv_connector": "RaidenOffloadConnector",
             "kv_connector_module_path": "tpu_inference.offload.raiden_offload_connector", "kv_role": "kv_both"}
CHUNKS = 24  # the host pool (TPU_OFFLOAD_NUM_CPU_CHUNKS): a few prompts' blocks, so it fills up


@pytest.fixture(scope="module")
def offload(model_dir, tmp_path_factory):
    """One sidecar and one engine on tpu-inference's RaidenOffloadConnector over it."""
    from harness.tinymodel import BLOCK_BYTES
    from harness.tpu_engines import Pods, TpuEngine

    pods = Pods(tmp_path_factory.mktemp("upstream-offload"), "upstream-offload")
    try:
        car = pods.sidecar("h", dram_bytes=8 << 20, block_bytes=BLOCK_BYTES)
        pods.start(engine=TpuEngine("upstream-offload", EngineSpec(str(model_dir), pods.work, CONNECTOR), env={
            "TPUSYNC_UPSTREAM_API": "1", "TPUSYNC_CONTROL_SOCKET": car.control_socket,
            "TPU_OFFLOAD_NUM_CPU_CHUNKS": str(CHUNKS)}))
        yield pods.engines["engine"], car
    finally:
        pods.close()


def pool_blocks(car) -> int:
    with KVStore.connect(f"unix://{car.control_socket}") as store:
        return int(store.stats()["blocks"])


def test_the_connector_runs_on_tpusync_upstream(offload):
    """The engine loaded upstream's module paths from tpusync, not from an upstream install."""
    engine, _ = offload
    log = engine.log_path.read_text(errors="replace")
    assert "Raiden Worker: C++ KVCacheManager Initialized." in log
    assert "not importable" not in log


def test_prefix_comes_back_from_the_sidecar_after_the_device_cache_is_reset(offload, reference):
    engine, car = offload
    p = prompt(41, 200)  # 6 full blocks
    before, held = engine.stats(), pool_blocks(car)
    assert engine.generate(p, max_tokens=16)["token_ids"] == reference(p)
    d = delta(engine.stats(), before)
    assert d["upstream_d2h_blocks"] >= 6 and d["upstream_copy_errors"] == 0
    assert pool_blocks(car) - held >= 6  # the chunks are in the sidecar's pool

    engine.call("reset_prefix_cache")  # the device cache forgets the prompt
    before = engine.stats()
    assert engine.generate(p, max_tokens=16)["token_ids"] == reference(p)
    d = delta(engine.stats(), before)
    assert d["upstream_h2d_blocks"] == 6 and d["upstream_copy_errors"] == 0


def test_a_partial_prefix_loads_its_shared_blocks(offload, reference):
    engine, _ = offload
    stored = prompt(42, 200)
    engine.generate(stored, max_tokens=1)
    engine.call("reset_prefix_cache")
    p = stored[:128] + prompt(43, 90)  # the first 4 blocks are shared
    before = engine.stats()
    assert engine.generate(p, max_tokens=16)["token_ids"] == reference(p)
    assert delta(engine.stats(), before)["upstream_h2d_blocks"] == 4


def test_a_full_host_pool_refuses_saves_and_stays_right(offload, reference):
    """More prompts than the host pool holds. As upstream: the worker's chunks stay locked until
    the scheduler's directory evicts their entries, which it does only when it is full, so once
    fewer chunks are free than a save needs, d2h_auto_allocate refuses it (RESOURCE_EXHAUSTED,
    logged by the connector) and the prompt is not offloaded. Every prompt still gives the
    reference tokens, and the prompts saved before still come back from the pool."""
    engine, _ = offload
    prompts = [prompt(50 + i, 200) for i in range(5)]  # 30 blocks; the pool has 24, partly used above
    before = engine.stats()
    for p in prompts:
        assert engine.generate(p, max_tokens=4)["token_ids"] == reference(p, 4)
    d = delta(engine.stats(), before)
    assert d["upstream_pool_full"] > 0 and d["upstream_copy_errors"] == 0
    assert "RESOURCE_EXHAUSTED" in engine.log_path.read_text(errors="replace")
    engine.call("reset_prefix_cache")
    before = engine.stats()
    assert engine.generate(prompts[0], max_tokens=16)["token_ids"] == reference(prompts[0])
    assert delta(engine.stats(), before)["upstream_h2d_blocks"] == 6  # saved while there was room
    assert engine.generate(prompts[-1], max_tokens=16)["token_ids"] == reference(prompts[-1])
