"""A running tpu-inference engine updated in place from tpusync (tpusync.engines.tpu_inference.weights).

Engine `rl` starts on checkpoint A. A torch trainer in this process publishes checkpoint B on
the engine's sidecar; the engine takes it through TPUWorker's weight-update calls and tpusync's
worker extension, and then generates exactly what HF transformers generates from B.
"""

from __future__ import annotations

import pytest
from conftest import Reference

from harness.engines import EngineError, prompt
from tpusync import KVStore, VersionedWeights

MODEL = "tiny-policy"
P = prompt(400, 70)


def publish(sidecar, checkpoint, version: int) -> None:
    from safetensors.torch import load_file

    sync = VersionedWeights(KVStore.connect(f"unix://{sidecar.control_socket}"), MODEL)
    sync.publish(load_file(checkpoint / "model.safetensors"), version)
    sync.close()


def update(engine, sidecar, version: int, timeout_s: float = 60) -> list:
    engine.weights("start_weight_update")  # TPUWorker frees the KV cache for the update
    try:
        return engine.weights("collective_rpc", "tpusync_update_weights",
                              kwargs={"model": MODEL, "version": version, "timeout_s": timeout_s,
                                      "control_socket": sidecar.control_socket})
    finally:
        engine.weights("finish_weight_update")  # ... and allocates it again
        engine.call("reset_prefix_cache")       # vLLM's prefix cache holds KV of the old weights


def test_engine_updated_in_place_generates_what_the_new_checkpoint_does(engines, weights_host, reference, model_b):
    rl = engines["rl"]
    assert rl.generate(P)["token_ids"] == reference(P)
    want = Reference(model_b)(P)
    assert want != reference(P), "checkpoints A and B must generate differently"

    publish(weights_host, model_b, 1)
    assert update(rl, weights_host, 1) == [1]  # one worker, version 1
    assert rl.generate(P)["token_ids"] == want


def test_a_version_that_never_arrives_leaves_the_engine_serving(engines, weights_host, model_b):
    rl = engines["rl"]
    with pytest.raises(EngineError, match="did not arrive"):
        update(rl, weights_host, 2, timeout_s=1)
    assert rl.generate(P)["token_ids"] == Reference(model_b)(P)  # still B


def test_an_update_after_the_sidecar_restarted_connects_again(engines, model_dir, model_b, reference, tmp_path):
    """The extension keeps its sidecar connection from update to update (its pool mapping stays
    warm); one lost to a restart is replaced, and the update goes through."""
    from harness.sidecar_pools import lone_sidecar
    from tpusync.local.sidecars import relaunch

    rl = engines["rl"]
    with lone_sidecar(tmp_path, "tpur", b"tpu-inference-restart-0123456789\n", dram_bytes=16 << 20,
                      block_bytes=64 << 10) as host:
        publish(host, model_dir, 1)
        assert update(rl, host, 1) == [1]
        assert rl.generate(P)["token_ids"] == reference(P)  # checkpoint A again
        host.stop()
        again = relaunch(host)
        try:
            publish(again, model_b, 2)
            assert update(rl, again, 2) == [2]
            assert rl.generate(P)["token_ids"] == Reference(model_b)(P)
        finally:
            again.stop()
