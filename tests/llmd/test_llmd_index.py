"""Properties of what llm-d's indexer (v0.9.0, tests/llmd/indexer) learns from reference engines
with real sidecars: every block an engine can load instead of computing is in the index for
that pod, at the tier its store holds it, and the holder of the longest prefix scores first.

Matched blocks are llm-d's own blocks (blockSizeTokens of its token processor): an engine
holding `n` full pages of `page` tokens serves n*page tokens, which is n*page // block of them.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness.llmd_fleet import connect, eventually, parameters, served
from tpusync.kv.keys import BlockHasher
from tpusync.store import KVStore, Tier

PAGES = (16, 32, 64)
LENGTHS = (1, 15, 16, 17, 31, 32, 33, 64, 100, 127, 128, 129, 255, 256, 300, 511, 512, 700)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def held_tokens(n_tokens: int, page: int) -> int:
    return n_tokens // page * page


@pytest.fixture(scope="module")
def fleet(cluster):
    """One engine per page size, each on its own sidecar; an indexer per llm-d block size that
    divides the page sizes it watches (16: all, 32: pages 32 and 64, 64: page 64)."""
    engines = {p: cluster.engine(cluster.host(p), p) for p in PAGES}
    indexers = {b: cluster.indexer(parameters(b)) for b in PAGES}
    probe = tokens(999, 64)
    for b, ix in indexers.items():
        for p, e in engines.items():
            if p % b == 0:
                connect(ix, e, probe)
    return engines, indexers


def test_matched_blocks_equal_the_full_blocks_the_holder_serves(fleet):
    engines, indexers = fleet
    for i, n in enumerate(LENGTHS):
        prompt = tokens(i, n)
        holder_page = PAGES[i % len(PAGES)]
        holder = engines[holder_page]
        # The others hold the first half: the holder must still score first when it has more.
        for p, e in engines.items():
            if e is not holder and n // 2 >= p:
                seq = e.complete(prompt[:n // 2])["tpusync"]["kv_events_seq"]
                assert all(ix.sync(e, seq) for b, ix in indexers.items() if p % b == 0)
        r = holder.complete(prompt)
        seq = r["tpusync"]["kv_events_seq"]
        if n < holder_page:
            assert seq == -1, "an engine announced a block that is not full"
        for b, ix in indexers.items():
            if holder_page % b:
                continue
            if seq >= 0:
                assert ix.sync(holder, seq)
            got = ix.score(prompt)
            assert got["totalBlocks"] == n // b
            want = {e.pod: held_tokens(n if e is holder else n // 2, p) // b for p, e in engines.items()
                    if p % b == 0}
            matched = {pod: s["matchedBlocks"] for pod, s in got["pods"].items()}
            assert matched == {pod: m for pod, m in want.items() if m}, (n, b, holder_page)
            if want[holder.pod]:
                assert got["pods"][holder.pod]["tiers"] == {"cpu": want[holder.pod]}
            if want[holder.pod] > max((m for pod, m in want.items() if pod != holder.pod), default=0):
                assert got["order"][0] == holder.pod, (n, b, got)


def test_blocks_received_by_pd_and_pulled_from_a_peer_are_announced(cluster):
    page = 32
    p_host, d_host = cluster.host(page), cluster.host(page)
    prefill = cluster.engine(p_host, page, role="prefill")
    decode = cluster.engine(d_host, page, role="decode", peers=[p_host.sidecar.address])
    ix = cluster.indexer(parameters(16))
    probe = tokens(998, 64)
    connect(ix, prefill, probe)
    connect(ix, decode, probe)

    # P/D: the decode pod received the prompt's blocks from the prefill pod's sidecar.
    prompt = tokens(100, 333)
    first = served(ix, prefill, prompt)
    r = served(ix, decode, prompt, max_tokens=3, kv_transfer_params=first["kv_transfer_params"])
    assert r["tpusync"]["pulled_blocks"] == 333 // page
    got = ix.score(prompt)
    full = held_tokens(333, page) // 16
    assert {pod: s["matchedBlocks"] for pod, s in got["pods"].items()} == {prefill.pod: full, decode.pod: full}

    # A prefix pulled from a peer, then the rest computed: the decode pod holds all of it.
    shared = tokens(101, 200)
    served(ix, prefill, shared)
    longer = shared + tokens(102, 150)
    r = served(ix, decode, longer)
    assert r["tpusync"]["pulled_blocks"] == 200 // page
    got = ix.score(longer)
    assert got["pods"][decode.pod]["matchedBlocks"] == held_tokens(350, page) // 16
    assert got["pods"][prefill.pod]["matchedBlocks"] == held_tokens(200, page) // 16
    assert got["order"][0] == decode.pod


def store_tiers(host, prompt: list[int], page: int) -> dict[str, int]:
    """Per llm-d tier name, how many of the prompt's blocks from the first the sidecar holds on
    that tier (the run the router's producer counts per tier)."""
    keys = BlockHasher(page).keys(prompt)
    with KVStore.connect(f"unix://{host.sidecar.control_socket}") as store:
        tiers = store.lookup(keys).tiers
    counts = {}
    for name, bit in (("cpu", Tier.DRAM), ("disk", Tier.DISK), ("shared_storage", Tier.SHARED)):
        run = next((i for i, t in enumerate(tiers) if not int(t) & bit), len(tiers))
        if run:
            counts[name] = run
    return counts


def test_tiers_follow_the_store_and_blocks_restored_after_a_restart_are_announced(cluster):
    page = 32
    host = cluster.host(page, disk=True)
    engine = cluster.engine(host, page)
    ix = cluster.indexer(parameters(32))
    probe = tokens(997, 64)
    connect(ix, engine, probe)
    prompt = tokens(200, 320)
    keys = BlockHasher(page).keys(prompt)
    served(ix, engine, prompt)
    assert ix.score(prompt)["pods"][engine.pod]["tiers"] == store_tiers(host, prompt, page) == {"cpu": 10}

    # The first half goes to disk; the engine restarts (same pod, same ports) and a router that
    # starts afresh subscribes: the restored blocks are loaded, not computed, and announced.
    with KVStore.connect(f"unix://{host.sidecar.control_socket}") as store:
        store.evict(keys[:5])
    engine.stop()
    engine.start()
    fresh = cluster.indexer(parameters(32))
    ix.forget(engine)
    connect(ix, engine, probe)
    connect(fresh, engine, probe)
    r = engine.complete(prompt)
    assert r["tpusync"]["cached_tokens"] >= 256 and r["tpusync"]["computed_tokens"] < 320
    for index in (ix, fresh):
        assert index.sync(engine, r["tpusync"]["kv_events_seq"])
        got = index.score(prompt)["pods"][engine.pod]
        assert got["matchedBlocks"] == 10
        assert got["tiers"] == store_tiers(host, prompt, page)


def test_demotion_and_eviction_by_the_sidecar_reach_the_index(cluster):
    """The sidecar moves blocks by itself; the engine's store audit (every 0.2 s here) tells the
    router: a demoted block is on disk, an evicted one is gone, and the pod that lost the
    prefix stops scoring first."""
    page = 32
    audit = ["--kv-events-audit-s", "0.2"]
    a_host, b_host = cluster.host(page, disk=True), cluster.host(page)
    a = cluster.engine(a_host, page, extra=audit)
    b = cluster.engine(b_host, page, extra=audit)
    ix = cluster.indexer(parameters(32, kvCacheBackendConfigs=[{"name": "gpu", "weight": 1.0},
                                                               {"name": "cpu", "weight": 0.8},
                                                               {"name": "disk", "weight": 0.5}]))
    probe = tokens(996, 64)
    connect(ix, a, probe)
    connect(ix, b, probe)
    prompt = tokens(300, 320)
    keys = BlockHasher(page).keys(prompt)
    served(ix, b, prompt[:160])
    served(ix, a, prompt)
    got = ix.score(prompt)
    assert got["order"] == [a.pod, b.pod]
    assert got["pods"][a.pod]["tiers"] == {"cpu": 10} and got["pods"][b.pod]["tiers"] == {"cpu": 5}

    with KVStore.connect(f"unix://{a_host.sidecar.control_socket}") as store:
        store.evict(keys)  # DRAM -> disk
        assert store_tiers(a_host, prompt, page) == {"disk": 10}

        def on_disk():
            pods = ix.score(prompt)["pods"]
            return pods.get(a.pod, {}).get("tiers") == {"disk": 10} and pods
        pods = eventually(on_disk)
        assert pods and pods[a.pod]["matchedBlocks"] == 10, pods

        store.evict(keys)  # disk -> gone
        assert store_tiers(a_host, prompt, page) == {}

    def a_gone():
        got = ix.score(prompt)
        return a.pod not in got["pods"] and got
    got = eventually(a_gone)
    assert got and got["order"] == [b.pod], got
    assert got["pods"][b.pod]["matchedBlocks"] == 5


def test_blocks_left_on_the_shared_tier_are_scored_at_its_weight(cluster):
    """A pod whose blocks left its DRAM for the shared tier (write-through, then evicted) is
    told to llm-d as holding them on SHARED_STORAGE, scored by the indexer at the weight the
    operator renders for it (builders/llmd.py TIER_WEIGHTS), below a pod holding them in DRAM."""
    from tpusync_operator.builders.llmd import TIER_WEIGHTS

    page = 32
    audit = ["--kv-events-audit-s", "0.2"]
    shared = cluster.work / "shared"
    shared.mkdir()
    a_host, b_host = cluster.host(page, shared_dir=shared), cluster.host(page)
    a = cluster.engine(a_host, page, extra=audit)
    b = cluster.engine(b_host, page, extra=audit)
    ix = cluster.indexer(parameters(32, kvCacheBackendConfigs=[{"name": n, "weight": w} for n, w in TIER_WEIGHTS]))
    probe = tokens(995, 64)
    connect(ix, a, probe)
    connect(ix, b, probe)
    prompt = tokens(301, 320)
    keys = BlockHasher(page).keys(prompt)
    served(ix, a, prompt)
    served(ix, b, prompt)
    with KVStore.connect(f"unix://{a_host.sidecar.control_socket}") as store:
        store.flush()       # written through to the shared tier
        store.evict(keys)   # out of DRAM: only the shared tier holds them now
    assert store_tiers(a_host, prompt, page) == {"shared_storage": 10}

    def on_shared():
        pods = ix.score(prompt)["pods"]
        return pods.get(a.pod, {}).get("tiers") == {"shared_storage": 10} and ix.score(prompt)
    got = eventually(on_shared)
    assert got, ix.score(prompt)
    assert got["pods"][a.pod]["matchedBlocks"] == 10
    assert got["order"] == [b.pod, a.pod]  # DRAM (0.8) outscores the shared tier (0.4)


def test_every_pod_that_mounts_the_shared_tier_is_scored_for_its_blocks(cluster):
    """Pods a, b and c mount one shared tier; only a serves the prompt. b's and c's engines
    never saw it, yet llm-d's indexer scores them for all of it at the shared tier's weight:
    their sidecars' scans found a's blocks on the tier, and their engines announced them under
    their own topics from the records a's engine wrote beside them. a (DRAM) ranks first; d,
    which does not mount the tier, is not scored. When the blocks leave the tier (another
    host's evictor), b and c leave the score and a stays. No audit runs: the feed alone."""
    import time

    from tpusync_operator.builders.llmd import TIER_WEIGHTS

    page = 32
    no_audit = ["--kv-events-audit-s", "0"]
    shared = cluster.work / "shared-every-pod"
    shared.mkdir()
    hosts = [cluster.host(page, shared_dir=shared, shared_scan_ms=100) for _ in range(3)] + [cluster.host(page)]
    a, b, c, d = (cluster.engine(h, page, extra=no_audit) for h in hosts)
    ix = cluster.indexer(parameters(32, kvCacheBackendConfigs=[{"name": n, "weight": w} for n, w in TIER_WEIGHTS]))
    probe = tokens(994, 64)
    for e in (a, b, c, d):
        connect(ix, e, probe)
    prompt = tokens(302, 320)
    start = time.monotonic()
    served(ix, a, prompt)

    def everywhere():
        got = ix.score(prompt)
        pods = got["pods"]
        return all(pods.get(e.pod, {}).get("tiers") == {"shared_storage": 10} for e in (b, c)) and got
    got = eventually(everywhere)
    assert got, ix.score(prompt)
    print(f"\nanother host's blocks scored for every pod on the tier {time.monotonic() - start:.2f} s after the "
          "request (sidecar scans every 0.1 s)")
    assert got["pods"][a.pod]["tiers"] == {"cpu": 10}
    assert got["order"][0] == a.pod and set(got["order"][1:]) == {b.pod, c.pod}
    assert d.pod not in got["pods"]

    for f in shared.glob("tpusync-shared-v2/*/*/??/*"):
        f.unlink()

    def left():
        got = ix.score(prompt)
        return got["order"] == [a.pod] and got
    got = eventually(left)
    assert got, ix.score(prompt)
