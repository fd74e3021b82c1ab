"""Weight synchronization between real sidecar processes (one per simulated host)."""

from __future__ import annotations

import ctypes
import re
import threading
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

from tests.integration.conftest import engine
from tests.torn_reads import TornReadWatcher
from tpusync.errors import InvalidArgumentError, UnavailableError
from tpusync.weights import VersionedWeights, WeightDistributor
from tpusync.weights.head import read_head
from tpusync.weights.storage import read_commit, read_manifest, version_keys

from .conftest import line, manager_for, publish, sampler_result
from .model import digest, params


def pulled_out(host) -> float:
    """Blocks this host's sidecar served to peers (its /metrics)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{host.http_port}/metrics", timeout=5).read().decode()
    m = re.search(r'^tpusync_transfer_blocks_total\{direction="out",op="pull",tier="dram"\} (\S+)$', text, re.M)
    return float(m.group(1))


@pytest.mark.parametrize("samplers", [1, 2, 4])
def test_byte_exact_receipt_one_copy_per_host(hosts, procs, samplers):
    n_hosts = min(samplers, 2)
    trainer, *sampler_hosts = hosts(1 + n_hosts)
    manifest = publish(trainer, seed=7, version=1)
    mgr = manager_for(trainer, sampler_hosts)
    report = mgr.transfer(["trainer"], None, "m")
    assert report.ok and sorted(report.committed) == sorted(h.address for h in sampler_hosts)
    want = digest(params(7))
    runs = [procs("sampler", sampler_hosts[i % n_hosts], 1) for i in range(samplers)]
    for p in runs:
        assert sampler_result(p) == {"version": 1, "digest": want}
    # One copy of the data left the trainer host, whatever the number of hosts and samplers (a
    # chain); the executor writes the small manifest and commit record on each host itself.
    assert pulled_out(trainer) == len(manifest.blocks())
    metrics = mgr.get_metrics()
    assert metrics["bytes_moved"] == manifest.nbytes * n_hosts and metrics["transfers"] == 1


def test_atomic_swap_across_hosts(hosts):
    trainer, host = hosts(2)
    mgr = manager_for(trainer, [host])
    shapes = {f"l{i}": (70_000 * (i + 1),) for i in range(5)}  # 1 to 6 blocks per leaf
    sampler = VersionedWeights(engine(host), "m")
    sampler.bind_weights({k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()})
    trainer_sync = VersionedWeights(engine(trainer), "m", blocks_per_chunk=3)
    with TornReadWatcher(sampler) as reader:
        for v in range(1, 6):
            trainer_sync.publish({k: jnp.full(s, v, jnp.float32) for k, s in shapes.items()}, v)
            assert mgr.transfer(["trainer"], None, "m").ok
            assert sampler.poll() == v
            assert reader.saw(v)
    assert not reader.torn and reader.seen == {1, 2, 3, 4, 5}


@pytest.mark.parametrize("in_flight", [1, 2, 4])
def test_killed_relay_is_routed_around(hosts, in_flight):
    """With any number of chunk pulls in flight per host (each on its own control channel)."""
    trainer, a, b, c = hosts(4)
    # 10 chunks: more than the 2 + in_flight - 1 the relay can hold when it dies (below)
    manifest = VersionedWeights(engine(trainer), "m", blocks_per_chunk=2).publish(params(3), 1)
    mgr = manager_for(trainer, [a, b, c], in_flight=in_flight)  # chain: trainer -> a -> b -> c
    assert list(mgr.plan(["trainer"], None, chunks=2).path(trainer.address, c.address)) == \
        [trainer.address, a.address, b.address, c.address]

    b_has_two = threading.Event()

    def kill_relay(host, done, total, nbytes):
        if host == b.address and done == 2:
            b_has_two.set()
        if host == a.address and done >= 2:
            # The relay dies once b has taken two chunks from it; until then each of its pulls
            # stops after landing its chunk, so a holds at most in_flight more and b still
            # needs chunks from someone: the trainer, for what a never held.
            assert b_has_two.wait(60), "b took no chunk from a"
            a.kill()  # SIGKILL; a no-op once the process is gone

    report = mgr.transfer(["trainer"], None, "m", on_chunk=kill_relay)
    assert report.chunks > 4
    assert set(report.failed) == {a.address}, report.failed
    assert sorted(report.committed) == sorted([b.address, c.address])
    assert any(dead == a.address and new == trainer.address for _, dead, new in report.rerouted)
    for h in (b, c):
        s = VersionedWeights(engine(h), "m")
        s.bind_weights(params(0))
        assert s.poll() == 1 and digest(s.params) == digest(params(3))
    assert pulled_out(trainer) < 2 * len(manifest.blocks())  # b took from the trainer only what a lacked


def test_late_joiner_and_restarted_sampler_get_the_current_version(hosts, procs):
    trainer, host = hosts(2)
    mgr = manager_for(trainer, [host])
    publish(trainer, seed=1, version=1)
    assert mgr.transfer(["trainer"], None, "m").ok
    first = procs("sampler", host, 1)
    assert sampler_result(first) == {"version": 1, "digest": digest(params(1))}
    first.kill()  # the sampler dies
    first.wait()
    publish(trainer, seed=2, version=2)
    assert mgr.transfer(["trainer"], None, "m").ok
    for p in (procs("sampler", host, 0), procs("sampler", host, 0)):  # the restart, and a newcomer
        assert sampler_result(p) == {"version": 2, "digest": digest(params(2))}


def test_trainer_killed_mid_publish_leaves_the_previous_version(hosts, procs):
    trainer, host = hosts(2)
    mgr = manager_for(trainer, [host])
    first = procs("trainer", trainer, 1, 1)
    assert line(first) == "COMMITTED"
    dying = procs("trainer", trainer, 2, 2, "9")
    assert line(dying) == "STOPPED"  # nine blocks of version 2 are in the pool
    dying.kill()
    dying.wait()
    et = engine(trainer)
    assert read_head(et.pool_path, "m") == 1 and read_commit(et, "m", 2) is None
    # The current version stays pinned on the host though the processes that wrote it are gone.
    assert et.stats()["pinned"] == len(version_keys(read_manifest(et, "m", 1)))
    report = mgr.transfer(["trainer"], None, "m")  # the current version: 1
    assert report.ok and report.version == 1
    assert sampler_result(procs("sampler", host, 0)) == {"version": 1, "digest": digest(params(1))}
    assert read_commit(engine(host), "m", 2) is None
    again = procs("trainer", trainer, 2, 2)  # the restarted trainer publishes version 2 whole
    assert line(again) == "COMMITTED"
    assert mgr.transfer(["trainer"], None, "m").version == 2
    assert sampler_result(procs("sampler", host, 2)) == {"version": 2, "digest": digest(params(2))}


def test_push_weights_to_peers(hosts):
    trainer, p1, p2 = hosts(3)
    publish(trainer, seed=5, version=4)
    pusher = VersionedWeights(engine(trainer), "m")
    assert pusher.push_weights([p1.address, f"tpusync://{p2.address}"]).result(timeout=60) == 4
    for h in (p1, p2):
        s = VersionedWeights(engine(h), "m")
        s.bind_weights(params(0))
        assert s.wait_for_version(4, timeout=10) == 4 and digest(s.params) == digest(params(5))
        assert s.get_metrics()["host_version"] == 4


def test_in_flight_must_be_positive():
    with pytest.raises(InvalidArgumentError, match="in_flight"):
        WeightDistributor(in_flight=0)


def test_tree_plan_delivers_to_every_host(hosts):
    trainer, *rest = hosts(5)
    publish(trainer, seed=9, version=1)
    mgr = manager_for(trainer, rest, topology="tree", fanout=2)
    report = mgr.transfer(["trainer"], None, "m")
    assert report.ok and report.plan.max_fanout() == 2 and report.plan.depth(trainer.address) == 2
    for h in rest:
        s = VersionedWeights(engine(h), "m")
        s.bind_weights(params(0))
        assert s.poll() == 1 and digest(s.params) == digest(params(9))


def test_a_block_changed_in_the_sources_pool_is_never_committed(hosts):
    """Blocks that land are checked against the manifest by the digest computed as they
    arrived: a block whose bytes changed in the source's DRAM after publishing is caught on
    the first hop, and no host commits the version."""
    trainer, a, b = hosts(3)
    manifest = publish(trainer, seed=5, version=1)
    victim = manifest.blocks()[len(manifest.blocks()) // 2]
    with engine(trainer).acquire_many([victim.key]) as views:  # flip one byte in place
        addr = np.frombuffer(views[0], np.uint8).__array_interface__["data"][0]
        ctypes.memset(addr + 7, views[0][7] ^ 0xFF, 1)
    mgr = manager_for(trainer, [a, b])
    with pytest.raises(UnavailableError, match="failed to deliver"):
        mgr.transfer(["trainer"], None, "m")
    for h in (a, b):
        s = VersionedWeights(engine(h), "m")
        s.bind_weights(params(0))
        assert s.poll() is None
        assert engine(h).lookup([victim.key]).prefix_len == 0  # the bad copy was evicted
