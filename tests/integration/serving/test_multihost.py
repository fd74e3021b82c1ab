"""Multi-host slices of the reference engine, on real processes: each slice is one JAX program of
two processes (jax.distributed on the CPU, gloo collectives), each process with its own sidecar.
The KV cache is sharded over the slice's devices by kv heads: with 2 devices a host (tensor
parallelism 4) each host holds half the heads of every page; with 1 (tensor parallelism 2) too,
in one shard.

Tokens must equal the monolithic single-process engine's, every time: prefix-cached on a slice,
P/D from a prefill slice to a decode slice (host to host, each host pulling its own shards),
between slices of tensor parallelism 2 and 4 both ways (each decode shard reads only the parts
of the prefill's shards it overlaps), and with one decode host's sidecar gone (the slice
recomputes; nothing is loaded in part).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from harness.processes import free_port
from tests.integration.serving.requests import pd, post, prompt, tokens
from tests.integration.serving.stack import ServingStack
from tpusync import KVStore
from tpusync.engines.reference.model import ModelConfig
from tpusync.kv.keys import BlockHasher, shard_key
from tpusync.local import sidecars as sidecar
from tpusync.local.servers import start_server, start_slice

MODEL = {"max_seq": 1024, "layers": 2, "d_model": 128, "mlp": 256, "heads": 4, "kv_heads": 4, "head_dim": 32}
CFG = ModelConfig(**MODEL)
BLOCK = -(-CFG.page_bytes // 4096) * 4096
SHARDS = 4  # 2 hosts x 2 devices, one kv head each


# (role, hosts' names, devices per host): tensor parallelism 4 and 2, prefill and decode.
SLICES = {"prefill": ("prefill", ("p0", "p1"), 2), "decode": ("decode", ("d0", "d1"), 2),
          "prefill2": ("prefill", ("q0", "q1"), 1), "decode2": ("decode", ("e0", "e1"), 1)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A sidecar per host of each slice (p0, p1 of the prefill slice, d0, d1 of the decode slice,
    q0, q1 and e0, e1 of the tensor-parallel-2 ones), the slices, and a monolithic engine on one
    device as the reference."""
    stack = ServingStack(tmp_path_factory.mktemp("mh"), BLOCK)
    env = {"JAX_PLATFORMS": "cpu"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    running = stack.running
    try:
        for _, hosts, _ in SLICES.values():
            for name in hosts:
                stack.sidecar(name)
        stack.add("mono", start_server("both", model_config=MODEL, prefix_cache=False))
        for name, (role, hosts, devices) in SLICES.items():
            stack.add(name, start_slice(role, [(running[h].control_socket, running[h].address) for h in hosts],
                                        model_config=MODEL, coordinator=f"127.0.0.1:{free_port()}",
                                        cpu_devices=devices, stderr=subprocess.DEVNULL))
        yield running
    finally:
        stack.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stored_keys(params: dict, p: list[int]) -> list[int]:
    """The block keys of prompt `p` that a prefill's kv_transfer_params say it stored (their last key)."""
    keys = BlockHasher(CFG.page_size).keys(p)[:params["remote_num_tokens"] // params["tpusync_block_size"]]
    assert params["tpusync_last_key"] == f"{keys[-1]:032x}"
    return keys


def held_shards(host, keys: list[int]) -> set[int]:
    """The shard numbers of which this host's sidecar holds every block of `keys`."""
    with KVStore.connect(f"unix://{host.control_socket}") as store:
        return {n for n in range(SHARDS)
                if store.lookup([shard_key(k, n, SHARDS) for k in keys]).prefix_len == len(keys)}


def test_a_slice_serves_the_monolithic_tokens_and_each_host_keeps_its_own_shards(cluster):
    p = prompt(1, 300)
    want = tokens(post(cluster["mono"].url, {"prompt": p, "max_tokens": 10}))
    first = post(cluster["prefill"].url, {"prompt": p, "max_tokens": 1})
    assert tokens(first) == want[:1]
    params = first["kv_transfer_params"]
    assert params["remote_addresses"] == [cluster["p0"].address, cluster["p1"].address]
    keys = stored_keys(params, p)
    assert len(keys) == 300 // CFG.page_size
    # Host 0 holds the first two kv heads (devices 0, 1), host 1 the other two; neither the whole block.
    assert held_shards(cluster["p0"], keys) == {0, 1} and held_shards(cluster["p1"], keys) == {2, 3}
    with KVStore.connect(f"unix://{cluster['p0'].control_socket}") as store:
        assert store.lookup(keys).prefix_len == 0

    # The same prompt again on the prefill slice: every host loads its shards, nothing recomputed
    # but the chunk that yields the first token.
    again = post(cluster["prefill"].url, {"prompt": p, "max_tokens": 1})
    assert tokens(again) == want[:1] and again["tpusync"]["cached_tokens"] == 256


def test_pd_between_two_slices_pulls_host_to_host(cluster):
    shared = prompt(2, 400)
    for i in range(2):
        p = shared + prompt(20 + i, 150)
        want, first, decoded = pd(cluster["mono"].url, cluster["prefill"].url, cluster["decode"].url, p, 12)
        assert tokens(decoded) == want
        st = decoded["tpusync"]
        assert st["cached_tokens"] == len(p) // CFG.chunk * CFG.chunk and st["prefix_cache"] == "ok"
        keys = stored_keys(first["kv_transfer_params"], p)
        assert held_shards(cluster["d0"], keys) == {0, 1} and held_shards(cluster["d1"], keys) == {2, 3}
        # Each host pulled only its half of each block: the blocks the first request lacked.
        assert st["pulled_bytes"] == st["pulled_blocks"] * CFG.page_bytes // 2


@pytest.mark.parametrize(("prefill", "decode"), [("prefill2", "decode"), ("prefill", "decode2")],
                         ids=["tp2-to-tp4", "tp4-to-tp2"])
def test_pd_between_slices_of_another_tensor_parallelism_reshards_on_load(cluster, prefill, decode):
    p = prompt(4 if decode == "decode" else 5, 420)
    want = tokens(post(cluster["mono"].url, {"prompt": p, "max_tokens": 10}))
    first = post(cluster[prefill].url, {"prompt": p, "max_tokens": 1})
    params = first["kv_transfer_params"]
    src = params["tpusync_kv_layout"]["shards"]
    assert src == (2 if prefill == "prefill2" else 4)
    decoded = post(cluster[decode].url, {"prompt": p, "max_tokens": 10, "kv_transfer_params": params})
    assert tokens(decoded) == want
    st = decoded["tpusync"]
    assert st["cached_tokens"] == 384 and st["prefix_cache"] == "ok"
    keys = stored_keys(params, p)
    # Each decode host pulled only the prefill's parts its heads overlap: half of every block.
    assert st["pulled_blocks"] == len(keys) and st["pulled_bytes"] == len(keys) * CFG.page_bytes // 2
    # ... and keeps the pages under its own split's keys, for its own prefix cache.
    hosts = SLICES[decode][1]
    mine = {"decode": ({0, 1}, {2, 3}), "decode2": ({0}, {1})}[decode]
    dst = 4 if decode == "decode" else 2
    for host, shards in zip(hosts, mine):
        with KVStore.connect(f"unix://{cluster[host].control_socket}") as store:
            assert {n for n in range(dst) if store.lookup([shard_key(k, n, dst) for k in keys]).prefix_len
                    == len(keys)} == shards
    again = post(cluster[decode].url, {"prompt": p, "max_tokens": 10})
    assert tokens(again) == want and again["tpusync"]["cached_tokens"] == 384


def test_a_prefill_whose_pages_are_not_this_models_is_refused(cluster):
    p = prompt(6, 300)
    want = tokens(post(cluster["mono"].url, {"prompt": p, "max_tokens": 6}))
    params = post(cluster["prefill"].url, {"prompt": p, "max_tokens": 1})["kv_transfer_params"]
    params["tpusync_kv_layout"]["head_size"] = 64  # another model's pages under the same block keys
    decoded = post(cluster["decode"].url, {"prompt": p, "max_tokens": 6, "kv_transfer_params": params})
    assert tokens(decoded) == want
    assert decoded["tpusync"]["pulled_blocks"] == 0 and decoded["tpusync"]["cached_tokens"] == 0


def test_a_decode_host_without_its_sidecar_makes_the_slice_recompute(cluster):
    """Host d1's sidecar goes away: its lookups and pulls fail, the slice agrees on no cached
    prefix and computes the whole prompt; the tokens are still the monolithic run's."""
    p = prompt(3, 350)
    want = tokens(post(cluster["mono"].url, {"prompt": p, "max_tokens": 8}))
    first = post(cluster["prefill"].url, {"prompt": p, "max_tokens": 1})
    assert cluster["d1"].stop() == 0
    decoded = post(cluster["decode"].url, {"prompt": p, "max_tokens": 8,
                                           "kv_transfer_params": first["kv_transfer_params"]})
    assert tokens(decoded) == want
    st = decoded["tpusync"]
    assert st["cached_tokens"] == 0 and st["computed_tokens"] == 350 and st["prefix_cache"] == "unavailable"
    # Host d0 pulled its shards (its sidecar is up); the slice did not load them without d1's.
    keys = stored_keys(first["kv_transfer_params"], p)
    assert held_shards(cluster["d0"], keys) == {0, 1}


def test_a_host_whose_sidecar_restarted_serves_the_slice_again(cluster):
    """Host d1's sidecar comes back (after the test above stopped it) on its pool: the host's
    process reconnects at its first store call and the slice loads P/D blocks again, host to host."""
    cluster["d1"] = sidecar.relaunch(cluster["d1"])
    p = prompt(4, 350)
    want, first, decoded = pd(cluster["mono"].url, cluster["prefill"].url, cluster["decode"].url, p, 8)
    assert tokens(decoded) == want
    st = decoded["tpusync"]
    assert st["prefix_cache"] == "ok" and st["cached_tokens"] == len(p) // CFG.chunk * CFG.chunk
    keys = stored_keys(first["kv_transfer_params"], p)
    assert held_shards(cluster["d1"], keys) == {2, 3}
