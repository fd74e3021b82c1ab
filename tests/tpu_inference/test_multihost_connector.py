"""tpusync's tpu-inference connector on multi-host slices, on real processes: each slice host is
a JAX process of a multi-process program (jax.distributed on the CPU, gloo), its KV cache made by
tpu-inference's own code (its mesh and `create_kv_caches`: one global array per layer, sharded
over the kv heads of every device of every host), running the connector's worker half against
its own sidecar; the engine core is tpusync's scheduler half with vLLM's KVOutputAggregator
merging the hosts' outputs (`slice_engine.py`).

Why not tpu-inference's own multi-host engine: tpu-inference 0.32.0 runs a slice as one Ray
worker per host and relies on libtpu to join the hosts' JAX processes into one program (it never
calls jax.distributed.initialize); on the CPU backend each Ray worker would be a lone JAX process
that sees only its own devices, so a mesh over the slice cannot be built. The connector's per-host
logic is therefore driven here with tpu-inference's own sharding code, and every step goes to
every host as its Ray executor sends it.

Every check is on the bytes of the KV cache: after a load, each page must equal the KV computed
for its tokens, on every host, whatever split the prefill used.
"""

from __future__ import annotations

import os
import subprocess
import uuid

import numpy as np
import pytest

from harness.polling import wait_for
from tests.tpu_inference.slice_engine import SliceEngine
from tpusync import KVStore
from tpusync.kv.events import event_hash
from tpusync.kv.keys import shard_key
from tpusync.local import sidecars as sidecar
from tpusync.local.sidecars import write_secret

PAGE = 16
BLOCK = 2 * 2 * PAGE * 2 * 4 * 128 * 2  # layers x tokens (of 32-token pages) x K/V x kv heads x head dim x bf16
HOSTS = ("p0", "p1", "d0", "d1", "s0", "e0", "e1", "g0", "g1", "k0", "k1")


class Sidecars(dict):
    """A sidecar per host; start(name) starts one, or restarts it on its pool file and socket."""

    def __init__(self, work) -> None:
        super().__init__()
        self.work, self.secret = work, write_secret(work / "secret", uuid.uuid4().hex * 2)
        self.pools = {name: f"/dev/shm/tpusync-mhc-{uuid.uuid4().hex[:8]}" for name in HOSTS}

    def start(self, name: str) -> None:
        self[name] = sidecar.launch(pool_path=self.pools[name], secret_file=self.secret, dram_bytes=32 << 20,
                                    block_bytes=BLOCK, control_socket=str(self.work / f"{name}.sock"),
                                    stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory):
    running = Sidecars(tmp_path_factory.mktemp("mhc"))
    try:
        for name in HOSTS:
            running.start(name)
        yield running
    finally:
        for s in running.values():
            s.stop()
        for pool in running.pools.values():
            for path in (pool, pool + ".lock"):
                if os.path.exists(path):
                    os.unlink(path)


def hosts(sidecars, *names):
    return [(sidecars[n].control_socket, sidecars[n].address) for n in names]


@pytest.fixture(scope="module")
def engines(sidecars):
    """Prefill and decode slices of 2 hosts x 2 devices (tensor parallelism 4; a prefill slice with
    KV events on too), a decode engine on
    one host of 2 devices (tensor parallelism 2), and decode slices of 2 hosts x 1 device with pages
    of 16 and of 32 tokens."""
    made = {}
    try:
        made["prefill"] = SliceEngine("prefill", hosts(sidecars, "p0", "p1"), devices=2, engine_id="prefill")
        made["decode"] = SliceEngine("decode", hosts(sidecars, "d0", "d1"), devices=2, engine_id="decode")
        made["events"] = SliceEngine("prefill", hosts(sidecars, "k0", "k1"), devices=2, engine_id="events",
                                     kv_events=True)
        made["single"] = SliceEngine("decode", hosts(sidecars, "s0"), devices=2, engine_id="single")
        made["decode2"] = SliceEngine("decode", hosts(sidecars, "e0", "e1"), devices=1, engine_id="decode2")
        made["decode32"] = SliceEngine("decode", hosts(sidecars, "g0", "g1"), devices=1, page_tokens=2 * PAGE,
                                       engine_id="decode32")
        for e in made.values():
            e.ready()
        yield made
    finally:
        for e in made.values():
            e.stop()


def prompt(seed: int, blocks: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 30000, blocks * PAGE).tolist()


def assert_kv(engine: SliceEngine, tokens: list[int], pages: list[int]) -> None:
    np.testing.assert_array_equal(engine.page_kv(pages), engine.expected(tokens, len(pages)))


def held(side, keys: list[int], shards: int) -> set[int]:
    """The shard numbers of which this sidecar holds every block of `keys`."""
    with KVStore.connect(f"unix://{side.control_socket}") as store:
        return {n for n in range(shards) if store.lookup([shard_key(k, n, shards) for k in keys]).prefix_len
                == len(keys)}


def block_keys(engine: SliceEngine, tokens: list[int]) -> list[int]:
    return engine.sched.scope.keys(tokens)


def test_each_host_saves_its_own_shards_and_the_prefill_names_every_host(engines, sidecars):
    p = prompt(1, 6)
    served = engines["prefill"].serve("a", p)
    assert served.loaded == 0
    assert_kv(engines["prefill"], p, served.pages)
    params = served.params
    assert params["remote_addresses"] == [sidecars["p0"].address, sidecars["p1"].address]
    assert params["tpusync_kv_layout"]["hosts"] == [[0, 1], [2, 3]]
    assert params["remote_num_tokens"] == 6 * PAGE
    keys = block_keys(engines["prefill"], p)
    assert held(sidecars["p0"], keys, 4) == {0, 1} and held(sidecars["p1"], keys, 4) == {2, 3}


def test_a_prefix_cached_on_every_host_is_loaded_by_every_host(engines):
    p = prompt(2, 5)
    engines["prefill"].serve("b1", p)
    again = engines["prefill"].serve("b2", p + prompt(3, 2))
    assert again.loaded == 5 and again.recomputed == 0
    assert_kv(engines["prefill"], p + prompt(3, 2), again.pages)


def test_a_block_one_host_lacks_is_not_offered(engines, sidecars):
    p = prompt(4, 6)
    engines["prefill"].serve("c1", p)
    keys = block_keys(engines["prefill"], p)
    with KVStore.connect(f"unix://{sidecars['p1'].control_socket}") as store:
        store.evict([shard_key(keys[3], n, 4) for n in (2, 3)])  # host 1 loses its part of block 3
    again = engines["prefill"].serve("c2", p)
    assert again.loaded == 3 and again.recomputed == 0
    assert_kv(engines["prefill"], p, again.pages)


def test_pd_between_slices_pulls_host_to_host(engines, sidecars):
    p = prompt(5, 6)
    first = engines["prefill"].serve("d", p)
    keys = block_keys(engines["prefill"], p)
    decoded = engines["decode"].serve("d", p + prompt(6, 1), first.params)
    assert decoded.loaded == 6 and decoded.recomputed == 0
    assert_kv(engines["decode"], p + prompt(6, 1), decoded.pages)
    # Each decode host pulled only the shards its devices hold, from the prefill host holding them.
    assert held(sidecars["d0"], keys, 4) == {0, 1} and held(sidecars["d1"], keys, 4) == {2, 3}


@pytest.mark.parametrize("decode", ["single", "decode2"])
def test_pd_to_another_split_reshards_on_each_host(engines, sidecars, decode):
    """Tensor parallelism 4 over two hosts to 2 on one host (each of its shards takes two parts,
    one from each prefill host), and to 2 over two hosts of one device."""
    p = prompt(7 if decode == "single" else 8, 5)
    first = engines["prefill"].serve(f"r-{decode}", p)
    decoded = engines[decode].serve(f"r-{decode}", p + prompt(9, 1), first.params)
    assert decoded.loaded == 5 and decoded.recomputed == 0
    assert_kv(engines[decode], p + prompt(9, 1), decoded.pages)


def test_pd_to_a_slice_of_another_split_and_page_size(engines, sidecars):
    """Pages of 32 tokens over 2 hosts x 1 device from the prefill's 16-token blocks over 2 x 2:
    each page takes two blocks, each host the two parts of each its heads overlap."""
    p = prompt(16, 8)  # 8 blocks of 16: 3 pages of 32 loaded (the last page holds the last token)
    first = engines["prefill"].serve("h", p)
    decoded = engines["decode32"].serve("h", p, first.params)
    assert decoded.loaded == 3 and decoded.recomputed == 0
    assert_kv(engines["decode32"], p, decoded.pages)
    keys = block_keys(engines["prefill"], p)
    assert held(sidecars["g0"], keys[:6], 4) == {0, 1} and held(sidecars["g1"], keys[:6], 4) == {2, 3}


def test_a_slice_decodes_from_a_single_host_prefill_of_another_split(engines, sidecars):
    """The single-host engine (tensor parallelism 2) as the prefill: each decode host of the
    tensor-parallel-4 slice pulls the one part of each block its shards overlap."""
    single = engines["single"]
    single.sched.save = True
    try:
        p = prompt(10, 4)
        first = single.serve("s", p, {"do_remote_decode": True})
    finally:
        single.sched.save = False
    assert "remote_addresses" not in first.params
    decoded = engines["decode"].serve("s", p + prompt(11, 1), first.params)
    assert decoded.loaded == 4 and decoded.recomputed == 0
    assert_kv(engines["decode"], p + prompt(11, 1), decoded.pages)
    keys = block_keys(single, p)
    assert held(sidecars["d0"], keys, 2) == {0} and held(sidecars["d1"], keys, 2) == {1}


def test_a_decode_host_whose_sidecar_is_down_makes_the_slice_recompute(engines, sidecars):
    p = prompt(12, 5)
    first = engines["prefill"].serve("f", p)
    sidecars["e1"].stop()
    try:
        decoded = engines["decode2"].serve("f", p + prompt(13, 1), first.params)
        assert decoded.loaded == 0  # host 0 pulled its part, host 1 could not: nothing is offered
        assert_kv(engines["decode2"], p + prompt(13, 1), decoded.pages)
    finally:
        sidecars.start("e1")
    # The host's sidecar is back (its pool survived): the next request pulls and loads again.
    p2 = prompt(14, 4)
    first = engines["prefill"].serve("g", p2)
    decoded = engines["decode2"].serve("g", p2 + prompt(15, 1), first.params)
    assert decoded.loaded == 4
    assert_kv(engines["decode2"], p2 + prompt(15, 1), decoded.pages)


def test_kv_events_announce_a_block_once_every_host_holds_its_parts(engines, sidecars):
    engine = engines["events"]
    p = prompt(17, 5)
    engine.serve("k", p)
    keys = block_keys(engine, p)
    stored = [e for e in engine.sched.take_events() if type(e).__name__ == "BlockStored"]
    assert [h for e in stored for h in e.block_hashes] == [event_hash(k) for k in keys]
    assert {e.medium for e in stored} == {"CPU"}
    # Host 1's sidecar drops its parts of block 2: the slice no longer holds blocks 2 on (a
    # prefix), and the audit (woken now, not at its period) withdraws them.
    with KVStore.connect(f"unix://{sidecars['k1'].control_socket}") as store:
        store.evict([shard_key(keys[2], n, 4) for n in (2, 3)])
    removed: list[int] = []

    def withdrawn() -> bool:
        engine.sched.events._wake.set()
        removed.extend(h for e in engine.sched.take_events() if type(e).__name__ == "BlockRemoved"
                       for h in e.block_hashes)
        return event_hash(keys[2]) in removed

    wait_for("block 2 withdrawn", withdrawn, 30)
    assert event_hash(keys[0]) not in removed and event_hash(keys[1]) not in removed


def test_the_hosts_hold_no_pins_once_requests_end(engines, sidecars):
    for name in ("p0", "p1", "d0", "d1", "k0", "k1"):
        with KVStore.connect(f"unix://{sidecars[name].control_socket}") as store:
            assert store.stats()["pinned"] == 0, name
