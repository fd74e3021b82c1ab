"""The reference engine on the shared tier: real sidecars on one shared directory, a prompt's
KV computed on one host and served on a fresh one (an empty DRAM pool, no disk, no peer to pull
from), with the tokens of a recompute."""

from __future__ import annotations

import os
import uuid

import numpy as np

import tpusync
from tpusync.engines.reference.engine import Engine
from tpusync.engines.reference.model import ModelConfig
from tpusync.local import sidecars as sidecar
from tpusync.local.sidecars import write_secret

CFG = ModelConfig(max_seq=2048, layers=2, d_model=128, mlp=256)
BLOCK = -(-CFG.page_bytes // 4096) * 4096


def test_a_prefix_from_the_shared_tier_on_a_fresh_host_decodes_as_recompute(tmp_path):
    secret = tmp_path / "secret"
    write_secret(secret, uuid.uuid4().hex * 2)
    shared = str(tmp_path / "shared")
    os.makedirs(shared)

    pools: list[str] = []

    def host(name: str) -> sidecar.Sidecar:
        # peers=[]: this sidecar dials no other one; the shared tier is its only way to another's blocks.
        pools.append(f"/dev/shm/tpusync-shared-eng-{uuid.uuid4().hex[:8]}")
        return sidecar.launch(pool_path=pools[-1],
                              secret_file=str(secret), dram_bytes=256 * BLOCK, block_bytes=BLOCK,
                              control_socket=str(tmp_path / f"{name}.sock"), shared_dir=shared,
                              shared_layout="reference;tp=1", peers=[])

    prompt = np.random.default_rng(1).integers(0, 256, 1000).tolist()
    recomputed = Engine(CFG, role="both").generate(prompt, 12)
    try:
        with host("a") as a, host("b") as b:
            with tpusync.KVStore.connect(f"unix://{a.control_socket}") as store_a:
                first = Engine(CFG, role="both", store=store_a).generate(prompt, 12)
                store_a.flush()
            with tpusync.KVStore.connect(f"unix://{b.control_socket}") as store_b:
                served = Engine(CFG, role="both", store=store_b).generate(prompt, 12)
                stats = store_b.stats()
    finally:
        for pool in pools:
            if os.path.exists(pool):
                os.unlink(pool)
    loadable = (len(prompt) - 1) // CFG.chunk * CFG.chunk  # whole prefill chunks, one token left to compute
    assert first.stats.cached_tokens == 0
    assert served.stats.cached_tokens == loadable  # loaded from the tier, not computed
    assert stats["hits_shared"] >= loadable // CFG.page_size and stats["shared"]["writes"] == 0
    assert served.tokens == recomputed.tokens == first.tokens
