"""A trainer spread over two hosts: two real JAX processes (jax.distributed on the CPU, gloo)
each publish the shards they hold into their own host's sidecar as one part of the version;
the manager streams both parts to two sampler hosts, which commit the merged version.
Samplers on one device receive it byte-exact (resharded through host buffers)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import engine
from tpusync import errors
from tpusync.weights import WeightDistributor
from tpusync.weights.head import read_head
from tpusync.weights.manifest import merge_parts
from tpusync.weights.storage import read_manifest

from .conftest import line, sampler_result
from .model import digest, params
from .test_weights_sidecars import pulled_out


def manager(trainer_hosts, sampler_hosts) -> WeightDistributor:
    mgr = WeightDistributor()
    for i, h in enumerate(trainer_hosts):
        mgr.register_work_unit(f"trainer-{i}", host=h.address, control_socket=h.control_socket, role="trainer")
    for i, h in enumerate(sampler_hosts):
        mgr.register_work_unit(f"sampler-{i}", host=h.address, control_socket=h.control_socket)
    return mgr


def test_two_host_trainer_publishes_one_version(hosts, procs, trainer):
    t0, t1, s0, s1 = hosts(4)
    for p in trainer([t0, t1], version=1, seed=5):
        assert line(p) == "COMMITTED"
    parts = [read_manifest(engine(t), "m", 1, (i, 2)) for i, t in enumerate((t0, t1))]
    assert all(parts) and read_head(t0.pool_path, "m") is None      # a part is not a version
    whole = merge_parts(parts)
    assert all(p.blocks() for p in parts) and \
        len(whole.blocks()) == len(parts[0].blocks()) + len(parts[1].blocks())

    with manager([t0, t1], [s0, s1]) as mgr:
        report = mgr.transfer(None, None, "m")
        assert report.ok and report.version == 1 and sorted(report.committed) == sorted([s0.address, s1.address])
        # Each part left its trainer host once (a chain per part over the two sampler hosts).
        assert [pulled_out(t) for t in (t0, t1)] == [len(p.blocks()) for p in parts]
        want = digest(params(5))
        for h in (s0, s1):
            assert read_manifest(engine(h), "m", 1) == whole
            assert sampler_result(procs("sampler", h, 1)) == {"version": 1, "digest": want}

        with pytest.raises(errors.InvalidArgumentError, match="part 0 of 2"):
            mgr.transfer(["trainer-0"], None, "m")


def test_a_missing_part_commits_nothing(hosts, procs, trainer):
    """The second trainer process dies mid-publish of version 2: its part never commits, so
    no destination can commit version 2 and the samplers stay on version 1."""
    t0, t1, s0 = hosts(3)
    for p in trainer([t0, t1], version=1, seed=1):
        assert line(p) == "COMMITTED"
    with manager([t0, t1], [s0]) as mgr:
        assert mgr.transfer(None, None, "m").ok
        first, second = trainer([t0, t1], version=2, seed=2, stop_at={1: 3})
        assert line(first) == "COMMITTED" and line(second) == "STOPPED"
        second.kill()
        with pytest.raises(errors.NotFoundError, match="part 1 of 2 of version 2"):
            mgr.transfer(None, None, "m", version=2)
        assert mgr.transfer(None, None, "m").version == 1      # the newest version every part host has
    assert read_head(s0.pool_path, "m") == 1
    assert sampler_result(procs("sampler", s0, 0)) == {"version": 1, "digest": digest(params(1))}
