"""llm-d's own indexer (v0.9.0, tests/llmd/indexer) fed by real vLLM engines with
TPUSyncConnector over real sidecars: vLLM publishes its GPU cache, the connector the blocks the
sidecar holds for the engine (medium CPU for host DRAM, DISK). Every block an engine can load
from tpusync is in the index for that pod at the tier the sidecar holds it; what the sidecar
demotes or evicts is updated or removed.

Engines: a (kv_both on host s, which has a disk tier), b (kv_both on s too: a fresh engine
that loads what a saved), dec (kv_consumer on host d, pulls from s for P/D). Pods are the
topics' names; events travel over ipc:// sockets (no network address). a and b publish as the
operator deploys them: the connector on its own publisher, relayed with vLLM's on the pod's
endpoint (`kv_events_endpoint`, tpusync.engines.connector.relay), so what their sidecar changes reaches the
index while they are idle. dec publishes through vLLM's publisher alone (`take_events`), at its
steps.
"""

from __future__ import annotations

import itertools
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.engines import EngineSpec, delta, prompt
from harness.llmd_indexer import Indexer, Pod, connect, eventually, held, indexer_binary
from harness.polling import wait_for
from harness.sidecar_pools import kill_and_remove, pool_path, remove_pools
from harness.tinymodel import BLOCK_BYTES, BLOCK_SIZE, build
from tpusync.kv.keys import BlockHasher
from tpusync.local.sidecars import write_secret
from tpusync.store import KVStore

ROOT = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tpusync.local import sidecars as sidecar_mod

    binary = indexer_binary()
    work = tmp_path_factory.mktemp("llmd-vllm")
    secret = work / "secret"
    write_secret(secret, uuid.uuid4().hex.encode() * 2 + b"\n")
    sidecars, pools, pods, indexers = {}, [], {}, {}
    try:
        for name, disk in (("s", True), ("d", False)):
            pool = pool_path("vllm-llmd", name)
            pools.append(pool)
            sidecars[name] = sidecar_mod.launch(
                pool_path=pool, secret_file=str(secret), dram_bytes=64 << 20, block_bytes=BLOCK_BYTES,
                control_socket=str(work / f"{name}.sock"), disk_dir=str(work / f"disk-{name}") if disk else None,
                disk_bytes=128 << 20 if disk else 0, stderr=subprocess.DEVNULL)
        base = EngineSpec(str(build(work / "model")), work)
        s, d = sidecars["s"], sidecars["d"]
        pods["a"] = Pod("a", base, "kv_both", work, 8001, relay=True, control_socket=s.control_socket,
                        data_address=s.address)
        pods["b"] = Pod("b", base, "kv_both", work, 8002, relay=True, control_socket=s.control_socket)
        pods["dec"] = Pod("dec", base, "kv_consumer", work, 8003, control_socket=d.control_socket)
        for p in pods.values():
            p.engine.wait_ready()
        for block in (16, 32):
            ix = indexers[block] = Indexer(binary, block)
            for i, p in enumerate(pods.values()):
                connect(ix, p, seed=1000 + 100 * block + 10 * i)
        yield pods, indexers, sidecars
    finally:
        for p in pods.values():
            p.engine.stop()
        for ix in indexers.values():
            ix.stop()
        kill_and_remove(sidecars.values(), pools)


def sidecar_keys(tokens: list[int]) -> list[int]:
    return BlockHasher(BLOCK_SIZE).keys(tokens)  # the connector's keys (default hash_seed)


def test_computed_blocks_are_in_the_index_at_cpu_for_prompts_of_many_lengths(fleet: Any) -> None:
    pods, indexers, _ = fleet
    a = pods["a"]
    for i, n in enumerate((31, 32, 33, 64, 100, 255, 256, 300, 511)):
        tokens = prompt(100 + i, n)
        a.generate(tokens)
        for block, ix in indexers.items():
            want = held(n, block)
            if want:
                def announced(ix: Indexer = ix, tokens: list[int] = tokens, want: int = want) -> bool:
                    return ix.tiers(tokens, a.pod).get("cpu") == want
                assert eventually(announced), (n, block, ix.tiers(tokens, a.pod))
            else:  # not one full block: nothing to announce, nothing in the index
                assert "cpu" not in ix.tiers(tokens, a.pod), (n, block)


def test_blocks_evicted_from_vllm_stay_in_the_index_while_the_sidecar_serves_them(fleet: Any) -> None:
    """vLLM evicts a prompt from its GPU cache (BlockRemoved GPU); the sidecar still holds it, so
    the pod keeps it at cpu, matched blocks equal the blocks the engine then loads, and it scores
    first."""
    pods, indexers, _ = fleet
    a, ix = pods["a"], indexers[16]
    tokens = prompt(200, 330)  # 10 full blocks
    a.generate(tokens)
    for i in range(10):  # 300 blocks through a GPU cache of 256
        a.generate(prompt(210 + i, 960))
    got = eventually(lambda: "gpu" not in ix.tiers(tokens, a.pod) and ix.score(tokens))
    assert got, f"vLLM never evicted the prompt: {ix.tiers(tokens, a.pod)}"
    holder = got["pods"].get(a.pod, {})
    assert holder.get("tiers") == {"cpu": held(330, 16)}, got
    assert holder["matchedBlocks"] == held(330, 16)
    assert got["order"][0] == a.pod
    before = a.engine.stats()
    a.generate(tokens)
    assert delta(a.engine.stats(), before)["loaded_blocks"] * BLOCK_SIZE // 16 == held(330, 16)


def test_blocks_loaded_after_a_prefix_cache_reset_and_by_a_fresh_engine(fleet: Any) -> None:
    """A prefix-cache reset publishes AllBlocksCleared (at the engine's next step), which llm-d
    applies to every tier of the pod; the request that then loads the prompt from the sidecar
    announces it again, whether before the clear on a's relay (which announces again what the
    store holds once the clear has passed) or after it in vLLM's batch. Engine b,
    which never computed the prompt, loads it from the same sidecar and announces it for itself."""
    pods, indexers, _ = fleet
    a, b, ix = pods["a"], pods["b"], indexers[16]
    tokens = prompt(300, 300)  # 9 full blocks
    a.generate(tokens)
    assert eventually(lambda: ix.tiers(tokens, a.pod).get("cpu") == held(300, 16))
    a.engine.call("reset_prefix_cache")
    before = a.engine.stats()
    a.generate(tokens)
    assert delta(a.engine.stats(), before)["loaded_blocks"] == 9  # from the sidecar, not vLLM's cache
    assert eventually(lambda: ix.tiers(tokens, a.pod).get("cpu") == held(300, 16)), ix.tiers(tokens, a.pod)

    assert "cpu" not in ix.tiers(tokens, b.pod)
    before = b.engine.stats()
    b.generate(tokens)
    assert delta(b.engine.stats(), before)["loaded_blocks"] == 9
    assert eventually(lambda: ix.tiers(tokens, b.pod).get("cpu") == held(300, 16)), ix.tiers(tokens, b.pod)


def test_blocks_received_by_pd_are_in_the_index_for_the_decode_pod(fleet: Any) -> None:
    pods, indexers, _ = fleet
    a, dec = pods["a"], pods["dec"]
    tokens = prompt(400, 330)  # 10 full blocks
    params = a.generate(tokens, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    before = dec.engine.stats()
    dec.generate(tokens, max_tokens=3, kv_transfer_params=params)
    assert delta(dec.engine.stats(), before)["pulled_blocks"] == 10
    for block, ix in indexers.items():
        def received(ix: Indexer = ix, want: int = held(330, block)) -> bool:
            return ix.tiers(tokens, dec.pod).get("cpu") == want
        assert eventually(received), (block, ix.tiers(tokens, dec.pod))
        assert ix.tiers(tokens, a.pod).get("cpu") == held(330, block)


def test_demotion_and_eviction_by_the_sidecar_reach_the_index_from_idle_engines(
        fleet: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The sidecar writes the blocks behind to disk, then drops them: both engines of the host
    that announced them say so (from the sidecar's change feed, on their relays) while idle: an
    engine of this harness (vLLM's LLM) steps only inside a generate call, and none is made."""
    pods, indexers, sidecars = fleet
    a, b, ix = pods["a"], pods["b"], indexers[16]
    tokens = prompt(500, 300)  # 9 full blocks
    want = held(300, 16)
    a.generate(tokens)
    b.generate(tokens)
    for p in (a, b):
        assert eventually(lambda p=p: ix.tiers(tokens, p.pod).get("cpu") == want), ix.tiers(tokens, p.pod)
    keys = sidecar_keys(tokens)

    def on_disk(p: Pod) -> bool:
        tiers = ix.tiers(tokens, p.pod)
        return "cpu" not in tiers and tiers.get("disk") == want

    def gone(p: Pod) -> bool:
        tiers = ix.tiers(tokens, p.pod)
        return "cpu" not in tiers and "disk" not in tiers

    lag_ms: dict[str, float] = {}

    def reached(what: str, check: Callable[[Pod], bool], since: float) -> None:
        for p in (a, b):
            assert wait_for(what, lambda p=p: check(p), 60, interval=0.002, raise_on_timeout=False), \
                (p.pod, ix.tiers(tokens, p.pod))
            lag_ms[f"{what} {p.pod}"] = (time.monotonic() - since) * 1e3

    with KVStore.connect(f"unix://{sidecars['s'].control_socket}") as store:
        store.evict(keys)  # DRAM -> disk (written behind)
        since = time.monotonic()
        assert all(int(t) == 2 for t in store.lookup(keys).tiers)
        reached("demoted", on_disk, since)
        store.evict(keys)  # disk -> gone
        since = time.monotonic()
        assert not any(int(t) for t in store.lookup(keys).tiers)
        reached("evicted", gone, since)
    # The router's lag behind the sidecar, as llm-d's own index shows it (a figure, not a check:
    # timing is the benchmarks' business; its bound is within the polling of one /score call).
    with capsys.disabled():  # in make test's output
        print("\nKV-events lag, sidecar change to llm-d's index (ms):",
              ", ".join(f"{k} {v:.0f}" for k, v in lag_ms.items()))


def test_an_eviction_reaches_the_index_at_the_next_step_of_an_engine_without_a_relay(fleet: Any) -> None:
    """dec publishes through vLLM's publisher alone: what its sidecar evicts goes out with the
    next request it serves."""
    pods, indexers, sidecars = fleet
    a, dec, ix = pods["a"], pods["dec"], indexers[16]
    tokens = prompt(600, 330)  # 10 full blocks
    params = a.generate(tokens, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    dec.generate(tokens, max_tokens=3, kv_transfer_params=params)
    assert eventually(lambda: ix.tiers(tokens, dec.pod).get("cpu") == held(330, 16)), ix.tiers(tokens, dec.pod)
    seeds = itertools.count(20_000)
    with KVStore.connect(f"unix://{sidecars['d'].control_socket}") as store:
        store.evict(sidecar_keys(tokens))  # no disk tier on d: gone
    assert eventually(lambda: "cpu" not in ix.tiers(tokens, dec.pod),
                      step=lambda: dec.generate(prompt(next(seeds), 40))), ix.tiers(tokens, dec.pod)


def test_a_vllm_engine_on_another_host_of_the_shared_tier_is_scored_for_its_blocks(
        tmp_path: Path) -> None:
    """Hosts t and u mount one shared tier; vLLM engine sa on t serves a prompt (saved, written
    through to the tier). Engine su on u never saw it: its connector learns of the blocks from
    its sidecar's scan of the tier and announces them as SHARED_STORAGE under its own topic,
    from the records sa's connector wrote beside them; llm-d's indexer scores su for every one.
    When the files leave the tier, su's score goes, sa's (DRAM) stays."""
    from tpusync.local import sidecars as sidecar_mod

    work = tmp_path
    secret = work / "secret"
    write_secret(secret, uuid.uuid4().hex.encode() * 2 + b"\n")
    shared = work / "shared"
    shared.mkdir()
    cars, pools, pods = [], [], []
    ix = None
    try:
        for name in ("t", "u"):
            pool = pool_path("vllm-shared", name)
            pools.append(pool)
            cars.append(sidecar_mod.launch(
                pool_path=pool, secret_file=str(secret), dram_bytes=64 << 20, block_bytes=BLOCK_BYTES,
                control_socket=str(work / f"{name}.sock"), shared_dir=str(shared), shared_layout="tiny",
                extra=["--shared-evict-interval-ms=100"], stderr=subprocess.DEVNULL))
        base = EngineSpec(str(build(work / "model")), work)
        for name, car, port in (("sa", cars[0], 8011), ("su", cars[1], 8012)):
            pods.append(Pod(name, base, "kv_both", work, port, relay=True, control_socket=car.control_socket))
        for p in pods:
            p.engine.wait_ready()
        sa, su = pods
        ix = Indexer(indexer_binary(), 16)
        for i, p in enumerate(pods):
            connect(ix, p, seed=5000 + 10 * i)
        tokens = prompt(5100, 160)
        want = held(len(tokens), 16)
        sa.generate(tokens)
        assert eventually(lambda: ix.tiers(tokens, su.pod) == {"shared_storage": want}), ix.score(tokens)
        assert ix.tiers(tokens, sa.pod).get("cpu") == want
        for f in shared.glob("tpusync-shared-v2/*/*/??/*"):
            f.unlink()
        assert eventually(lambda: su.pod not in ix.score(tokens)["pods"]), ix.score(tokens)
        assert ix.tiers(tokens, sa.pod).get("cpu") == want
    finally:
        for p in pods:
            p.engine.stop()
        if ix is not None:
            ix.stop()
        for car in cars:
            car.stop()
        remove_pools(pools)
