"""VersionedWeights from and into torch: state dicts, FSDP-style shards, explicit casts, and
a JAX trainer feeding a torch sampler and back (one manifest for both frameworks).

Runs in the vLLM tier's environment (it has torch); the JAX end runs in the main .venv, as
another process, through the same sidecar.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

from tpusync import KVStore, VersionedWeights, errors
from tpusync.local import sidecars as sidecar_mod
from tpusync.local.sidecars import write_secret
from tpusync.weights import Shard, TemplateMismatchError

ROOT = Path(__file__).resolve().parents[2]
JAX_PY = ROOT / ".venv" / "bin" / "python"
JAX_PROC = Path(__file__).with_name("jax_weights_proc.py")


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    work = tmp_path_factory.mktemp("torch-weights")
    write_secret(work / "secret", b"torch-weights-secret-0123456789ab\n")
    pool = f"/dev/shm/tpusync-torchw-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    s = sidecar_mod.launch(pool_path=pool, secret_file=str(work / "secret"), dram_bytes=8 << 20, block_bytes=4096,
                           control_socket=str(work / "control.sock"), peers=[])
    yield s, work
    s.stop()
    if os.path.exists(pool):
        os.unlink(pool)
    shutil.rmtree(pool + ".weights", ignore_errors=True)


def sync(host, model: str) -> VersionedWeights:
    return VersionedWeights(KVStore.connect(f"unix://{host[0].control_socket}"), model)


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(300, 70, generator=g).to(torch.bfloat16),  # 11 blocks
            "norm.weight": torch.randn(15, generator=g),                          # one block: zero-copy
            "quant.scale": torch.randint(-128, 127, (64,), dtype=torch.int8, generator=g),
            "mask": torch.rand(33, generator=g) > 0.5}


def test_state_dict_round_trip(host):
    sd = state()
    trainer, sampler = sync(host, "sd"), sync(host, "sd")
    manifest = trainer.publish(sd, 1)
    assert {leaf.name: leaf.dtype for leaf in manifest.leaves} == \
        {"embed.weight": "bfloat16", "norm.weight": "float32", "quant.scale": "int8", "mask": "bool"}
    sampler.bind_weights({k: torch.empty_like(v) for k, v in sd.items()})
    assert sampler.wait_for_version(1, timeout=30) == 1
    got = sampler.params
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert sampler.get_metrics()["zero_copy_leaves"] >= 1  # norm.weight is the pool slot itself
    with pytest.raises(errors.PreconditionError, match="already committed"):
        trainer.publish(sd, 1)


def test_fsdp_shards_are_assembled(host):
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    rows = [Shard(full[:5], (8, 6), (0, 0)), Shard(full[5:], (8, 6), (5, 0))]
    cols = [Shard(full[:, 4:], (8, 6), (0, 4)), Shard(full[:, :4].contiguous(), (8, 6), (0, 0))]
    trainer, sampler = sync(host, "fsdp"), sync(host, "fsdp")
    trainer.publish({"rows": rows, "cols": cols}, 1)
    sampler.bind_weights({"rows": torch.empty(8, 6), "cols": torch.empty(8, 6)})
    sampler.wait_for_version(1, timeout=30)
    assert torch.equal(sampler.params["rows"], full) and torch.equal(sampler.params["cols"], full)

    with pytest.raises(errors.InvalidArgumentError, match=r"'bad'.*outside the global shape"):
        trainer.publish({"bad": [Shard(full, (8, 6), (1, 0))]}, 2)
    with pytest.raises(errors.InvalidArgumentError, match=r"'half'.*cover 24 of its 48"):
        trainer.publish({"half": [Shard(full[:4], (8, 6), (0, 0))]}, 2)  # a whole version, not a part


def test_dtype_conversion_is_explicit(host):
    w = torch.randn(40, 30).to(torch.bfloat16)
    sync(host, "cast").publish({"w": w}, 1)
    strict = sync(host, "cast")
    strict.bind_weights({"w": torch.empty(40, 30)})
    with pytest.raises(TemplateMismatchError, match=r"'w'.*float32.*bfloat16.*cast=True"):
        strict.wait_for_version(1, timeout=30)
    cast = sync(host, "cast")
    cast.bind_weights({"w": torch.empty(40, 30)}, cast=True)
    cast.wait_for_version(1, timeout=30)
    assert cast.params["w"].dtype == torch.float32 and torch.equal(cast.params["w"], w.float())


def _jax(op: str, host, model: str, version: int, out: Path) -> None:
    assert JAX_PY.exists(), f"{JAX_PY}: the main environment (make install) runs the JAX end"
    out.mkdir(exist_ok=True)
    done = subprocess.run([str(JAX_PY), str(JAX_PROC), op, host[0].control_socket, model, str(version), str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]


def _bytes(t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_jax_trainer_feeds_a_torch_sampler_and_back(host):
    work = host[1]
    _jax("publish", host, "xfw", 1, work / "jax1")      # JAX publishes bfloat16, float32, int32
    sampler = sync(host, "xfw")
    sampler.bind_weights({"w": torch.empty(96, 40, dtype=torch.bfloat16), "b": torch.empty(40),
                          "steps": torch.empty(3, dtype=torch.int32)})
    sampler.wait_for_version(1, timeout=30)
    for name, t in sampler.params.items():
        assert _bytes(t) == (work / "jax1" / f"{name}.bin").read_bytes(), name

    g = torch.Generator().manual_seed(7)
    mine = {"w": torch.randn(96, 40, generator=g).to(torch.bfloat16), "b": torch.randn(40, generator=g),
            "steps": torch.tensor([7, 8, 9], dtype=torch.int32)}
    sync(host, "xfw").publish(mine, 2)                  # torch publishes; JAX receives
    _jax("receive", host, "xfw", 2, work / "jax2")
    for name, t in mine.items():
        assert (work / "jax2" / f"{name}.bin").read_bytes() == _bytes(t), name
