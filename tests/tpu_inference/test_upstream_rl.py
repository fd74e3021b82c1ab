"""tpu-inference's own RL weight sync (tpu_inference/rl/raiden_worker_sync.py and TPUWorker's
bind_raiden_sync / raiden_h2d, as shipped in 0.32.0), unmodified, on tpusync: the sampler engine
runs with TPUSYNC_UPSTREAM_API=1, so `tpu_sync.api.jax.weight_synchronizer` is
tpusync.engines.upstream's, which writes each version into the bound weights in place. The CPU shim
lets the sampler bind weights on CPU devices (upstream binds TPU arrays only).

A trainer host's sidecar gets version 1 from a trainer stand-in (an engine on checkpoint B
publishing its weights in the sampler's bind order); WeightDistributor moves it to
the sampler host; the running sampler (checkpoint A) takes it between rollouts and then
generates exactly what transformers generates from B.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import Reference

from harness.engines import EngineSpec, prompt
from tpusync.weights import WeightDistributor

P = prompt(410, 70)


@pytest.fixture(scope="module")
def rl(model_dir, model_b, tmp_path_factory):
    """Sidecars t (trainer host) and s (sampler host); engine `sampler` on A over s; engine
    `trainer` on B over t, with the publishing extension."""
    from harness.tpu_engines import Pods, TpuEngine

    pods = Pods(tmp_path_factory.mktemp("upstream-rl"), "upstream-rl")
    try:
        t, s = (pods.sidecar(name, dram_bytes=32 << 20, block_bytes=1 << 20) for name in ("t", "s"))
        # The trainer's worker extension (rl_trainer_ext.py) lives beside this test.
        here = str(Path(__file__).parent)
        env = {"TPUSYNC_UPSTREAM_API": "1", "VLLM_HOST_IP": "127.0.0.1",
               "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        # Tensor parallel over 2 CPU devices: the weights are sharded over the engine's mesh, which
        # the sampler's registration metadata describes (single-device arrays carry no mesh).
        pods.start(sampler=TpuEngine("upstream-rl-sampler", EngineSpec(str(model_dir), pods.work),
                                     env=env | {"TPUSYNC_CONTROL_SOCKET": s.control_socket}, tensor_parallel_size=2),
                   trainer=TpuEngine("upstream-rl-trainer", EngineSpec(str(model_b), pods.work),
                                     env=env | {"TPUSYNC_CONTROL_SOCKET": t.control_socket},
                                     worker_extension_cls="rl_trainer_ext.PublishWeights", tensor_parallel_size=2))
        yield pods.engines, pods.sidecars
    finally:
        pods.close()


def test_the_running_sampler_takes_the_new_weights_in_place(rl, reference, model_b):
    engines, cars = rl
    sampler = engines["sampler"]
    [meta] = sampler.weights("collective_rpc", "bind_raiden_sync", kwargs={"job_name": "rollout"})
    assert meta["variables"] and meta["unit"]["job_name"] == "rollout" and meta["mesh_shape"]
    assert len(meta["shards"]) == 2  # this host's two shards of every weight
    assert sampler.generate(P)["token_ids"] == reference(P)
    want = Reference(model_b)(P)
    assert want != reference(P), "checkpoints A and B must generate differently"

    [published] = engines["trainer"].weights("collective_rpc", "publish_weights", kwargs={"version": 1})
    assert published == len(meta["variables"])
    with WeightDistributor() as mgr:
        mgr.register_work_unit("trainer", host=cars["t"].address, control_socket=cars["t"].control_socket,
                               role="trainer")
        mgr.register_work_unit("sampler", host=cars["s"].address, control_socket=cars["s"].control_socket)
        report = mgr.transfer(["trainer"], None, "rollout")
    assert report.ok and report.committed == [cars["s"].address]

    sampler.call("reset_prefix_cache")  # tpu-inference's contract: before start_weight_update
    sampler.weights("start_weight_update")
    try:
        assert sampler.weights("collective_rpc", "raiden_h2d", kwargs={"uuid": 1}) == [{}]
    finally:
        sampler.weights("finish_weight_update")
    assert sampler.generate(P)["token_ids"] == want
    [metrics] = sampler.weights("collective_rpc", "raiden_metrics")
    assert metrics["version"] == 1 and metrics["h2d_call_count"] == 1
