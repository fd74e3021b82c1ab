"""Weight sync across simulated hosts: every destination host runs its own
`python -m tpusync.weights receive` inside its network namespace, against its own sidecar;
the hosts meet only through the sidecars' data ports over the shaped fabric."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from harness import REPO as ROOT
from harness import fabric as fab
from tests.integration.conftest import engine
from tests.integration.weights.receive import committed, receive_command
from tpusync.weights import VersionedWeights, plan
from tpusync.weights.head import read_head

MIB = 1 << 20


def weights(mib: int, seed: int) -> dict:
    """`mib` bf16 leaves of 1 MiB each (4 blocks), deterministic per seed."""
    import jax.numpy as jnp
    import ml_dtypes

    rng = np.random.default_rng(seed)
    return {f"w{i:03d}": jnp.asarray(rng.standard_normal(MIB // 2, np.float32).astype(ml_dtypes.bfloat16))
            for i in range(mib)}


def receivers(trainer, cars, *, topology: str = plan.CHAIN, stall: float = 30.0) -> dict:
    """Starts `receive` inside each destination host; returns {address: process}."""
    args = [f"--source={trainer.address}", *(f"--destination={c.address}" for c in cars),
            f"--topology={topology}", "--fanout=2"]
    return {c.address: c.host.popen(receive_command(c, *args, stall=stall), stdout=subprocess.PIPE, text=True,
                                    cwd=ROOT) for c in cars}


def loaded(car, template: dict) -> dict:
    """What a sampler on that host loads: the committed version, from the host's pool."""
    sync = VersionedWeights(engine(car), "m")
    sync.bind_weights(template)
    assert sync.wait_for_version(1, timeout=30) == 1
    return {k: np.asarray(v).tobytes() for k, v in sync.params.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.asarray(a[k]).tobytes() == b[k] for k in a)


@pytest.mark.parametrize(("topology", "hosts"), [(plan.CHAIN, 4), (plan.TREE, 5)])
def test_weights_reach_every_host_one_copy_per_link(sidecars, topology, hosts):
    """chain: h0 (trainer) -> h1 -> h2 -> h3; tree, fan-out 2: h0 -> h1 -> {h2, h3}, h0 -> h4
    (or however the plan lays it out). Every host commits the version byte-exact, and the NIC
    counters show the plan's shape: each host received one copy, and each host sent one copy
    per child in the plan (the trainer too: not one per destination)."""
    f, (trainer, *cars) = sidecars(hosts, fab.DC)
    params = weights(8, seed=5)
    running = receivers(trainer, cars, topology=topology)
    before = f.counters()
    manifest = VersionedWeights(engine(trainer), "m", blocks_per_chunk=4).publish(params, 1)
    for p in running.values():
        assert "rerouted: none" in committed(p)
    crossed = {name: c - before[name] for name, c in f.counters().items()}
    for car in cars:
        assert read_head(car.pool_path, "m") == 1
        assert same(params, loaded(car, params))
    the_plan = plan.build_plan([trainer.address], [c.address for c in cars], chunks={trainer.address: 1},
                               topology=topology, fanout=2)
    size = manifest.nbytes
    for car in [trainer, *cars]:
        children = len(the_plan.children(trainer.address, car.address))
        sent = crossed[car.host.name].tx_bytes
        # payload plus TCP/IP headers (~3%) and small control messages; no extra copies
        assert children * size <= sent <= children * size * 1.1 + (1 << 20), (car.host, children, sent)
    for car in cars:
        assert size <= crossed[car.host.name].rx_bytes <= size * 1.1 + (1 << 20)


def test_a_relay_host_killed_mid_transfer_is_routed_around(sidecars):
    """Chain h0 -> h1 -> h2 -> h3 at 200 Mbit/s (16 MiB: ~0.7 s per hop). Once h2 has landed
    two chunks, relay h1 dies (its sidecar and receiver, SIGKILL): h2 goes to h0 for the rest,
    h3 keeps pulling from h2, and both commit the version byte-exact."""
    _f, (trainer, relay, h2, h3) = sidecars(4, fab.DC.replace(rate_mbit=200))
    params = weights(16, seed=6)
    running = receivers(trainer, [relay, h2, h3], stall=5.0)
    VersionedWeights(engine(trainer), "m", blocks_per_chunk=4).publish(params, 1)
    line = ""
    while not line.startswith("chunk 2/"):
        line = running[h2.address].stdout.readline()
        assert line, "h2's receiver ended before its second chunk"
    running[relay.address].kill()
    relay.kill()
    assert f"('{trainer.address}', '{relay.address}', '{trainer.address}')" in committed(running[h2.address])
    committed(running[h3.address])
    for car in (h2, h3):
        assert same(params, loaded(car, params))
