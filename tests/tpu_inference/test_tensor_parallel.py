"""tpusync's connector for tpu-inference with tensor parallelism: engines on two XLA host (CPU)
devices (`--xla_force_host_platform_device_count=2`, tensor_parallel_size 2), where
tpu-inference shards every layer's KV cache on the mesh's `model` axis, one KV head per device.
The workers store each shard's part of a block under its own key (`tpusync.kv.pages.shard_key`);
the scheduler half looks up and pulls every shard (`tpusync.engines.tpu_inference.shards`).

A prefill/decode pair of TP=2 engines in two processes over real sidecars: tokens equal HF
transformers' (which the plain engine equals, test_engine.py); the pool holds, per shard, the
bytes of the prefill engine's pages."""

from __future__ import annotations

import hashlib
import subprocess
import threading

import numpy as np
import pytest

from harness.engines import delta, prompt
from harness.polling import wait_for
from harness.sidecar_pools import kill_and_remove, pool_path
from tpusync import errors
from tpusync.engines.tpu_inference.shards import ShardedStore
from tpusync.kv.events import BlockAnnouncer, follow
from tpusync.kv.keys import BlockHasher, shard_key
from tpusync.local.sidecars import write_secret
from tpusync.store import KVStore, Tier

SECRET = b"tpu-inference-tp-tier-secret-0123456789"
TP = 2
PROMPT = prompt(31, 300)  # 9 full blocks and 12 tokens


@pytest.fixture(scope="module")
def tp_cluster(model_dir, tmp_path_factory):
    """Sidecars p (prefill pod) and d (decode pod); TP=2 engines prefill (kv_producer on p) and
    decode (kv_consumer on d), with the configs the operator renders."""
    from harness.tinymodel import BLOCK_BYTES
    from harness.tpu_engines import EngineSpec, TpuEngine, rendered_kv_transfer_config
    from tpusync.local import sidecars as sidecar_mod

    work = tmp_path_factory.mktemp("tpusync-tp")
    secret = work / "secret"
    write_secret(secret, SECRET + b"\n")
    sidecars, pools, engines = {}, [], {}
    try:
        for name in ("p", "d"):
            pool = pool_path("tpuinf-tp", name)
            pools.append(pool)
            sidecars[name] = sidecar_mod.launch(pool_path=pool, secret_file=str(secret), dram_bytes=32 << 20,
                                                block_bytes=BLOCK_BYTES, control_socket=str(work / f"{name}.sock"),
                                                stderr=subprocess.DEVNULL)
        for name, role, sc in (("prefill", "prefill", "p"), ("decode", "decode", "d")):
            kv = rendered_kv_transfer_config("tpusync", role, control_socket=sidecars[sc].control_socket,
                                             data_address=sidecars[sc].address)
            engines[name] = TpuEngine(f"tp-{name}", EngineSpec(str(model_dir), work, kv), tensor_parallel_size=TP)
        for e in engines.values():
            e.wait_ready()
        yield engines, sidecars
    finally:
        for e in engines.values():
            e.stop()
        kill_and_remove(sidecars.values(), pools)


def test_prefill_decode_pair_with_a_sharded_cache(tp_cluster, reference):
    engines, _ = tp_cluster
    assert engines["prefill"].call("page_digests")["shards"] == TP  # the cache really is sharded
    before = engines["prefill"].stats()
    out = engines["prefill"].generate(PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert out["token_ids"] == reference(PROMPT)[:1]
    assert delta(engines["prefill"].stats(), before)["saved_blocks"] == 9
    params = out["kv_transfer_params"]
    assert params["remote_num_tokens"] == 288
    before = engines["decode"].stats()
    got = engines["decode"].generate(PROMPT, max_tokens=16, kv_transfer_params=params)
    d = delta(engines["decode"].stats(), before)
    assert d["pulled_blocks"] == 9 and d["loaded_blocks"] == 9 and d["load_error_blocks"] == 0
    assert got["token_ids"] == reference(PROMPT)


def test_the_pool_holds_each_shard_of_the_engines_pages(tp_cluster):
    """Every block of the prompt is stored as TP parts, part n the bytes of shard n of one and
    the same page of the prefill engine's cache (vLLM's prefix cache still holds the pages)."""
    engines, sidecars = tp_cluster
    p = prompt(32, 200)  # 6 full blocks
    engines["prefill"].generate(p, max_tokens=1)
    pages = engines["prefill"].call("page_digests")["digests"]
    keys = BlockHasher(32).keys(p)
    with KVStore.connect(f"unix://{sidecars['p'].control_socket}") as store:
        stored = []
        for n in range(TP):
            with store.acquire_many([shard_key(k, n, TP) for k in keys]) as views:
                assert all(v is not None for v in views)
                stored.append([hashlib.blake2b(bytes(v), digest_size=16).hexdigest() for v in views])
    for i in range(len(keys)):
        at = [pid for pid in range(len(pages[0])) if pages[0][pid] == stored[0][i]]
        assert at, f"block {i}: shard 0 is no page of the engine's cache"
        assert any(all(pages[n][pid] == stored[n][i] for n in range(TP)) for pid in at), f"block {i}"
    assert len(set(stored[0]) | set(stored[1])) == 2 * len(keys)  # distinct parts: no shard stored twice


def test_sharded_store_view(tmp_path):
    """ShardedStore's block semantics on a real in-process store: a block is present only with
    every shard, pins of a partial block are dropped, tiers are those of all shards."""
    store = KVStore.local(dram_bytes=1 << 20, block_bytes=4096, pool_path=str(tmp_path / "pool"))
    view = ShardedStore(store, 2)
    keys = [11, 22, 33]
    blob = np.ones(4096, np.uint8)
    store.put([shard_key(k, n, 2) for k in keys[:2] for n in range(2)] + [shard_key(keys[2], 0, 2)], [blob] * 5)
    found = view.lookup(keys, pin=True)
    assert found.prefix_len == 2 and [int(t) for t in found.tiers] == [Tier.DRAM, Tier.DRAM, Tier.NONE]
    view.release(keys[:2])  # exactly the pins the lookup left: a pin too many or too few raises
    with pytest.raises(errors.PreconditionError):
        store.release([shard_key(keys[2], 0, 2)])
    view.evict(keys)  # no disk tier: out
    assert view.lookup(keys).prefix_len == 0 and store.lookup([shard_key(keys[2], 0, 2)]).prefix_len == 0
    store.close()


def test_pipeline_and_data_parallelism_stay_off_and_multi_host_slices_do_not(monkeypatch):
    """What the connector refuses (it then passes requests through untouched, saying why), and the
    hosts of a slice it counts (test_multihost_connector.py runs it on them)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tpusync.engines.tpu_inference.connector import TPUSyncConnector

    # The checks read only the configuration and the environment: a connector not yet started.
    connector = object.__new__(TPUSyncConnector)

    def reason(pp: int = 1, dp: int = 1) -> str | None:
        config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=pp, data_parallel_size=dp))
        return connector._unsupported(None, config, KVConnectorRole.WORKER, None)  # type: ignore[arg-type]

    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-0")
    assert reason() is None  # one host: tensor parallelism is fine
    assert reason(pp=2) == reason(dp=2) == "pipeline or data parallelism"
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-0,host-1")
    assert reason() is None and connector._hosts() == 2
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "")
    assert connector._hosts() == 1


def test_an_eviction_of_a_sharded_block_is_announced_from_the_change_feed(tmp_path):
    """The change feed names shards; through ShardedStore it names their blocks, so an engine
    with a sharded cache announces an eviction as the store makes it, with no audit."""
    store = KVStore.local(dram_bytes=1 << 20, block_bytes=4096, pool_path=str(tmp_path / "pool"))
    view = ShardedStore(store, 2)
    keys = [101, 202]
    store.put([shard_key(k, n, 2) for k in keys for n in range(2)], [np.ones(4096, np.uint8)] * 4)
    batches: list = []

    class Sink:
        def send(self, events):
            batches.append(events)
            return len(batches) - 1

    ann = BlockAnnouncer(Sink(), 2)
    ann.announce(keys, keys, [1, 2, 3, 4], view.where(keys).tolist(), 2)
    ann.describing = False
    stop = threading.Event()
    t = threading.Thread(target=follow, args=(ann, view, stop), kwargs={"wait_s": 0.2})
    t.start()
    try:
        store.evict([shard_key(keys[1], 1, 2)])  # one shard gone: the block is gone
        wait_for("the eviction announced", lambda: ["BlockRemoved", [202], "CPU"] in batches[-1], 30)
    finally:
        stop.set()
        t.join()
        store.close()
    assert not any(["BlockRemoved", [101], "CPU"] in b for b in batches)
