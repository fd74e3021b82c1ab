"""Real tpusync-sidecar processes (one per simulated host) and trainer/sampler processes."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.processes import free_port
from tests.integration.conftest import engine
from tpusync.weights import VersionedWeights, WeightDistributor

from .model import params

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def hosts(launch):
    """hosts(n) starts n more sidecars, h0, h1, ... (host 0 is the trainer's); all are killed afterwards."""
    numbers = itertools.count()

    def _start(n: int, dram_bytes: int = 64 << 20):
        return [launch(f"h{next(numbers)}", dram_bytes=dram_bytes, stderr=subprocess.DEVNULL) for _ in range(n)]

    return _start


@pytest.fixture
def run_module():
    """run_module(module, *args, env=None) starts `python -m module args` in the repository root, its
    stdin and stdout piped; all are killed afterwards."""
    started: list[subprocess.Popen] = []

    def _run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env, cwd=ROOT)
        started.append(p)
        return p

    yield _run
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture
def procs(run_module):
    """proc(role, host, version, seed, *extra) starts a trainer/sampler process; killed afterwards."""

    def _proc(role: str, host, version: int, seed: int = 0, *extra: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONPATH": str(ROOT)}
        return run_module("tests.integration.weights.proc", role, host.control_socket, "m", str(version), str(seed),
                          *extra, env=env)

    return _proc


@pytest.fixture
def trainer(run_module):
    """trainer(hosts, version, seed, stop_at=None) starts both processes of the JAX job."""

    def _start(trainer_hosts, version: int, seed: int, stop_at: dict[int, int] | None = None):
        port = free_port()
        return [run_module("tests.integration.weights.trainer_mp", host.control_socket, f"127.0.0.1:{port}", str(pid),
                           str(version), str(seed), *([str(stop_at[pid])] if stop_at and pid in stop_at else []))
                for pid, host in enumerate(trainer_hosts)]

    return _start


def line(p: subprocess.Popen) -> str:
    out = p.stdout.readline()
    assert out, f"process exited with {p.wait()} before answering"
    return out.strip()


def sampler_result(p: subprocess.Popen) -> dict:
    return json.loads(line(p))


def manager_for(trainer_host, sampler_hosts, **kw) -> WeightDistributor:
    mgr = WeightDistributor(**kw)
    mgr.register_work_unit("trainer", host=trainer_host.address, control_socket=trainer_host.control_socket,
                           role="trainer")
    for i, h in enumerate(sampler_hosts):
        mgr.register_work_unit(f"sampler-{i}", host=h.address, control_socket=h.control_socket)
    return mgr


def publish(host, seed: int, version: int, **kw):
    return VersionedWeights(engine(host), "m", blocks_per_chunk=4).publish(params(seed), version, **kw)
