"""tpusync's connector for tpu-inference (`tpusync.tpu_inference.connector`) in real engines on
real sidecars, configured with the --kv-transfer-config the operator renders for a vllm-tpu
serving (connector tpusync): a prefill/decode pair in two processes, the decode engine pulling
from the prefill pod's sidecar; a fresh engine served from the sidecar's DRAM and disk tiers,
whole prompts and shared prefixes; a dead peer, params keyed otherwise, a block that cannot be
loaded and a sidecar restarted under a running engine all mean recompute. Tokens equal HF
transformers' in every case. The fresh engine publishes KV events: llm-d's own indexer (the
helpers of harness/llmd_indexer.py) has its blocks at the tier the sidecar holds them."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.engines import delta, prompt
from harness.llmd_indexer import MODEL, Indexer, connect, eventually, held, indexer_binary
from harness.sidecar_pools import kill_and_remove, pool_path
from harness.tpu_engine_proc import BLOCK_SIZE
from tpusync.kv.keys import BlockHasher
from tpusync.local.sidecars import write_secret
from tpusync.store import KVStore

SECRET = b"tpu-inference-tier-secret-0123456789"
PROMPT = prompt(21, 300)  # 9 full blocks and 12 tokens
AUDIT_S = 0.2


@dataclass
class Cluster:
    work: Path
    engines: dict[str, Any] = field(default_factory=dict)
    sidecars: dict[str, Any] = field(default_factory=dict)
    pools: dict[str, str] = field(default_factory=dict)
    indexer: Indexer | None = None
    pod: Any = None  # the fresh engine as llm-d's indexer knows it

    def launch(self, name: str, disk: bool = False) -> Any:
        """Starts sidecar `name` (again: on the same pool file, disk folder and control socket)."""
        from harness.tinymodel import BLOCK_BYTES
        from tpusync.local import sidecars as sidecar_mod

        pool = self.pools.setdefault(name, pool_path("tpuinf", name))
        self.sidecars[name] = sidecar_mod.launch(
            pool_path=pool, secret_file=str(self.work / "secret"), dram_bytes=32 << 20, block_bytes=BLOCK_BYTES,
            control_socket=str(self.work / f"{name}.sock"), disk_dir=str(self.work / f"disk-{name}") if disk else None,
            disk_bytes=128 << 20 if disk else 0, stderr=subprocess.DEVNULL)
        return self.sidecars[name]

    def store(self, name: str) -> KVStore:
        return KVStore.connect(f"unix://{self.sidecars[name].control_socket}")


@dataclass
class TpuPod:
    """An engine under the name its KV-event topic carries (test_llmd_index's Pod, for TpuEngine)."""

    pod: str
    endpoint: str
    engine: Any

    def generate(self, tokens: list[int], max_tokens: int = 1, **kw: Any) -> dict[str, Any]:
        out: dict[str, Any] = self.engine.generate(tokens, max_tokens, **kw)
        return out


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """Sidecars p (prefill pod: DRAM over a disk tier) and d (decode pod); engines prefill
    (kv_producer on p), decode (kv_consumer on d; reconnects at once after a store failure),
    fresh (kv_both on p, publishing KV events to llm-d's indexer)."""
    from harness.tpu_engines import EngineSpec, TpuEngine, rendered_kv_transfer_config
    from tpusync_operator.builders.engine import VLLM_RELAYED_KV_EVENTS

    c = Cluster(tmp_path_factory.mktemp("tpusync-connector"))
    write_secret(c.work / "secret", SECRET + b"\n")

    def connector(role: str, sidecar, kv_role: str | None = None, kv_events_endpoint: str | None = None,
                  **extra: Any) -> EngineSpec:
        kv = rendered_kv_transfer_config("tpusync", role, kv_role=kv_role, control_socket=sidecar.control_socket,
                                         data_address=sidecar.address, kv_events_endpoint=kv_events_endpoint)
        kv["kv_connector_extra_config"].update(extra)
        return EngineSpec(str(model_dir), c.work, kv)

    try:
        binary = indexer_binary()
        p, d = c.launch("p", disk=True), c.launch("d")
        c.engines["prefill"] = TpuEngine("tpusync-prefill", connector("prefill", p))
        c.engines["decode"] = TpuEngine("tpusync-decode", connector("decode", d, retry_s=0))
        endpoint, pod = f"ipc://{c.work}/events-fresh", "127.0.0.1:8101"  # a name in the topic only
        # Published as the operator deploys it: vLLM's publisher in-process, relayed by the connector.
        c.engines["fresh"] = TpuEngine("tpusync-fresh", connector("decode", p, kv_role="kv_both",
                                                                  kv_events_endpoint=endpoint,
                                                                  kv_events_audit_s=AUDIT_S).events(
            VLLM_RELAYED_KV_EVENTS, f"kv@{pod}@{MODEL}"))
        for e in c.engines.values():
            e.wait_ready()
        c.indexer = Indexer(binary, BLOCK_SIZE)
        c.pod = TpuPod(pod, endpoint, c.engines["fresh"])
        connect(c.indexer, c.pod, seed=7000)
        yield c
    finally:
        for e in c.engines.values():
            e.stop()
        if c.indexer is not None:
            c.indexer.stop()
        kill_and_remove(c.sidecars.values(), c.pools.values())


def announced_at(c: Cluster, tokens: list[int]) -> dict[str, int]:
    """The tiers llm-d's index should give the fresh pod for `tokens`: every medium the sidecar
    holds all of the prompt's full blocks on (tpusync.store.Tier bits: DRAM 1, disk 2)."""
    with c.store("p") as store:
        tiers = [int(t) for t in store.lookup(BlockHasher(BLOCK_SIZE).keys(tokens)).tiers]
    want = held(len(tokens), BLOCK_SIZE)
    return {name: want for name, bit in (("cpu", 1), ("disk", 2)) if all(t & bit for t in tiers)}


def remote_decode_params(c: Cluster, p: list[int]) -> dict[str, Any]:
    """The kv_transfer_params the prefill engine answers for prompt p, prefilled for a remote
    decode: what a P/D router hands the decode engine."""
    out = c.engines["prefill"].generate(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params: dict[str, Any] = out["kv_transfer_params"]
    return params


def decoded(c: Cluster, p: list[int], params: dict[str, Any] | None) -> tuple[list[int], dict[str, int]]:
    """The decode engine's 16 tokens for prompt p given `params`, and what its counters did meanwhile."""
    before = c.engines["decode"].stats()
    got = c.engines["decode"].generate(p, max_tokens=16, kv_transfer_params=params)
    return got["token_ids"], delta(c.engines["decode"].stats(), before)


def test_prefill_decode_pair_over_sidecars(cluster, reference):
    engines = cluster.engines
    before = engines["prefill"].stats()
    out = engines["prefill"].generate(PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert delta(engines["prefill"].stats(), before)["saved_blocks"] == 9
    params = out["kv_transfer_params"]
    assert params["remote_num_tokens"] == 288 and params["remote_port"]
    tokens, d = decoded(cluster, PROMPT, params)
    assert d["pulled_blocks"] == 9 and d["loaded_blocks"] == 9 and d["load_error_blocks"] == 0
    assert tokens == reference(PROMPT)


def fresh_engine_loads(cluster, reference, p, blocks: int, tier: str) -> None:
    """An engine that never saw prompt p loads its blocks from the sidecar, gives the reference
    tokens, and llm-d's indexer shows the blocks at the sidecar's tier."""
    engines = cluster.engines
    before = engines["fresh"].stats()
    got = engines["fresh"].generate(p, max_tokens=16)
    d = delta(engines["fresh"].stats(), before)
    assert d["loaded_blocks"] == blocks and d["load_error_blocks"] == 0
    assert got["token_ids"] == reference(p)
    want = announced_at(cluster, p)
    assert want.get(tier) == blocks
    assert eventually(lambda: cluster.indexer.tiers(p, cluster.pod.pod) == {"gpu": blocks, **want}), \
        cluster.indexer.tiers(p, cluster.pod.pod)


def test_fresh_engine_served_from_the_dram_tier(cluster, reference):
    p = prompt(22, 200)  # 6 full blocks
    cluster.engines["prefill"].generate(p, max_tokens=1)
    fresh_engine_loads(cluster, reference, p, 6, "cpu")


def test_fresh_engine_served_from_the_disk_tier(cluster, reference):
    """The prompt's blocks left the sidecar's DRAM for its disk: the engine loads them from there
    (and they stay announced on disk, whether the load brought them back to DRAM or not)."""
    p = prompt(27, 200)  # 6 full blocks
    cluster.engines["prefill"].generate(p, max_tokens=1)
    keys = BlockHasher(BLOCK_SIZE).keys(p)
    with cluster.store("p") as store:
        store.evict(keys)  # DRAM -> disk (written behind)
        assert [int(t) for t in store.lookup(keys).tiers] == [2] * 6
    fresh_engine_loads(cluster, reference, p, 6, "disk")


def test_partial_prefix_hit(cluster, reference):
    """A prompt that shares only its first 5 blocks with a stored one loads those 5."""
    engines = cluster.engines
    stored = prompt(25, 300)
    engines["prefill"].generate(stored, max_tokens=1)
    p = stored[:160] + prompt(26, 100)
    before = engines["fresh"].stats()
    got = engines["fresh"].generate(p, max_tokens=16)
    d = delta(engines["fresh"].stats(), before)
    assert d["loaded_blocks"] == 5 and d["load_error_blocks"] == 0
    assert got["token_ids"] == reference(p)


def test_dead_prefill_peer_means_recompute(cluster, reference):
    import socket

    p = prompt(23, 150)
    params = remote_decode_params(cluster, p)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        params["remote_port"] = s.getsockname()[1]
    tokens, d = decoded(cluster, p, params)
    assert d["peer_errors"] == 1 and d["pulled_blocks"] == 0 and d["loaded_blocks"] == 0
    assert tokens == reference(p)


def test_params_from_an_engine_that_keyed_differently_mean_recompute(cluster, reference):
    p = prompt(24, 150)
    params = remote_decode_params(cluster, p)
    params["tpusync_last_key"] = f"{int(params['tpusync_last_key'], 16) ^ 1:032x}"  # another hash seed's key
    tokens, d = decoded(cluster, p, params)
    assert d["pulled_blocks"] == 0 and d["loaded_blocks"] == 0
    assert tokens == reference(p)


# kv_transfer_params any client may send, on top of the prefill's well-formed ones, and the field
# the refusal names. (Not an object at all never reaches the connector: vLLM's HTTP layer answers
# 400, and its own output processor reads the object first.)
MALFORMED = [
    ({"remote_port": "x"}, "remote_port"),
    ({"remote_port": [7600]}, "remote_port"),
    ({"tpusync_last_key": "zz"}, "tpusync_last_key"),
    ({"tpusync_kv_layout": {"shards": "1"}}, "tpusync_kv_layout.shards"),
    ({"remote_addresses": ["127.0.0.1:1", "prefill-1.pool.svc:7600"]}, "remote_addresses[1]"),
    ({"remote_host": "localhost"}, "remote_host"),  # a name: the sidecar would resolve it for the client
]


@pytest.mark.parametrize(("change", "field"), MALFORMED, ids=[f for _, f in MALFORMED])
def test_malformed_params_are_refused_and_the_prompt_computed(cluster, reference, change, field):
    """Refused (one warning naming the field, counted), never raised into vLLM's scheduler: the
    engine computes the prompt and keeps serving."""
    log = cluster.engines["decode"].log_path
    p = prompt(60 + MALFORMED.index((change, field)), 150)
    params = remote_decode_params(cluster, p)
    sent = {**params, **change}
    if "tpusync_kv_layout" in change:
        sent["tpusync_kv_layout"] = {**params["tpusync_kv_layout"], **change["tpusync_kv_layout"]}
    line = f"kv_transfer_params.{field} is "
    logged = log.read_text(errors="replace").count(line)
    tokens, d = decoded(cluster, p, sent)
    assert d["refused_prefills"] == 1 and d["pulled_blocks"] == 0 and d["loaded_blocks"] == 0, d
    assert tokens == reference(p)
    assert log.read_text(errors="replace").count(line) == logged + 1


def test_after_malformed_params_the_next_well_formed_request_pulls(cluster, reference):
    p = prompt(69, 150)
    tokens, d = decoded(cluster, p, remote_decode_params(cluster, p))
    assert d["pulled_blocks"] == 150 // BLOCK_SIZE and d["loaded_blocks"] == 150 // BLOCK_SIZE, d
    assert tokens == reference(p)


def test_a_block_that_cannot_be_loaded_is_recomputed_and_stored_again(cluster, reference):
    """Block 3 is replaced, after the save, by a block of another size under its key: the lookup
    offers all 9 (it cannot tell), the load stops at block 3, vLLM recomputes blocks 3-8
    (kv_load_failure_policy recompute) and the engine stores block 3 again. (A lookup pins what
    it offers, so a block cannot be evicted between lookup and load: a block that is there but
    cannot be loaded is what the load path meets.)"""
    engines = cluster.engines
    from harness.tinymodel import BLOCK_BYTES

    p = prompt(28, 300)
    engines["prefill"].generate(p, max_tokens=1)
    keys = BlockHasher(BLOCK_SIZE).keys(p)
    with cluster.store("p") as store:
        for _ in range(2):  # DRAM -> disk -> gone
            store.evict(keys[3:4])
        assert not store.lookup(keys[3:4]).tiers[0]
        store.put(keys[3:4], [np.zeros(1000, np.uint8)])
        before = engines["fresh"].stats()
        got = engines["fresh"].generate(p, max_tokens=16)
        d = delta(engines["fresh"].stats(), before)
        assert d["matched_tokens"] == 9 * BLOCK_SIZE
        assert d["loaded_blocks"] == 3 and d["load_error_blocks"] == 6
        assert got["token_ids"] == reference(p)
        assert d["saved_blocks"] == 1
        with store.acquire_many(keys[3:4]) as views:
            assert views[0] is not None and len(views[0]) <= BLOCK_BYTES and len(views[0]) != 1000


def test_decode_engine_outlives_its_sidecar_restarted_mid_run(cluster, reference):
    """The decode pod's sidecar dies under the running engine: a P/D request is computed without
    it; restarted (on the same pool and socket), it serves P/D to the same engine again, and what
    it pulled before it died is still in its pool."""
    p, q = prompt(29, 300), prompt(30, 150)
    params_p, params_q = remote_decode_params(cluster, p), remote_decode_params(cluster, q)
    tokens, _ = decoded(cluster, p, params_p)  # into d's pool
    assert tokens == reference(p)

    cluster.sidecars["d"].kill()
    tokens, d = decoded(cluster, q, params_q)
    assert d["store_errors"] >= 1 and d["pulled_blocks"] == 0 and d["loaded_blocks"] == 0
    assert tokens == reference(q)

    cluster.launch("d")
    cluster.engines["decode"].call("reset_prefix_cache")
    tokens, d = decoded(cluster, q, params_q)
    assert d["pulled_blocks"] == 4 and d["loaded_blocks"] == 4 and d["load_error_blocks"] == 0
    assert tokens == reference(q)
    tokens, d = decoded(cluster, p, None)  # pulled before the restart: in the pool still
    assert d["pulled_blocks"] == 0 and d["loaded_blocks"] == 9 and d["load_error_blocks"] == 0
    assert tokens == reference(p)
