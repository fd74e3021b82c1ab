"""Receiving without a central executor: every destination host runs its own
`python -m tpusync.weights receive` process against its own sidecar only, as on separate
machines; the hosts meet through the sidecars' data ports. Real processes throughout."""

from __future__ import annotations

import subprocess
import sys

from harness.processes import free_port
from tpusync.weights.codec import manifest_blocks
from tpusync.weights.head import read_head

from .conftest import ROOT, line, publish, sampler_result
from .model import digest, params
from .receive import committed, receive_command
from .test_weights_sidecars import pulled_out


def receivers(sources, destinations, *, version: int = 1, only=None, stall: float = 30.0) -> dict:
    """Starts `receive` on each destination (or those in `only`); returns {host: process}."""
    args = [f"--source={s.address}" for s in sources] + [f"--destination={d.address}" for d in destinations]
    return {d.address: subprocess.Popen(receive_command(d, *args, version=version, stall=stall),
                                        stdout=subprocess.PIPE, text=True, cwd=ROOT)
            for d in destinations if only is None or d in only}


def test_each_host_receives_on_its_own(hosts, procs):
    """The receivers start before the trainer publishes and wait for it; a chain of three
    hosts; one copy of the data leaves the trainer host."""
    t, a, b, c = hosts(4)
    running = receivers([t], [a, b, c])
    manifest = publish(t, seed=11, version=1)
    for p in running.values():
        assert "rerouted: none" in committed(p)
    want = digest(params(11))
    for h in (a, b, c):
        assert read_head(h.pool_path, "m") == 1
        assert sampler_result(procs("sampler", h, 1)) == {"version": 1, "digest": want}
    # The data once; each host fetched the small manifest (its reference and parts) itself.
    _, parts = manifest_blocks(manifest)
    assert pulled_out(t) == len(manifest.blocks()) + 3 * (len(parts) + 1)


def test_a_two_host_trainer_to_independent_receivers(hosts, procs, trainer):
    t0, t1, a, b = hosts(4)
    running = receivers([t0, t1], [a, b])
    for p in trainer([t0, t1], version=1, seed=4):
        assert line(p) == "COMMITTED"
    for p in running.values():
        committed(p)
    for h in (a, b):
        assert sampler_result(procs("sampler", h, 1)) == {"version": 1, "digest": digest(params(4))}


def test_dead_or_stalled_relays_are_routed_around(hosts, procs):
    """Chain t -> a -> b. a's sidecar is dead: b goes to t at once. Then a's sidecar is up but
    no receiver runs there: b waits `stall_seconds` for a's first chunk, then goes to t."""
    t, a, b = hosts(3)
    publish(t, seed=2, version=1)
    a.kill()
    assert f"('{t.address}', '{a.address}', '{t.address}')" in committed(receivers([t], [a, b], only=[b])[b.address])
    assert sampler_result(procs("sampler", b, 1)) == {"version": 1, "digest": digest(params(2))}

    t, a, b = hosts(3)
    publish(t, seed=3, version=1)
    out = committed(receivers([t], [a, b], only=[b], stall=1.0)[b.address])
    assert f"('{t.address}', '{a.address}', '{t.address}')" in out
    assert read_head(a.pool_path, "m") is None
    assert sampler_result(procs("sampler", b, 1)) == {"version": 1, "digest": digest(params(3))}


def test_a_host_its_sidecar_cannot_reach_is_refused_at_once(hosts):
    """--host lists an address where no sidecar answers (a typo'd port): the receiver says so
    and exits before it waits for the version (it used to wait out --timeout-seconds, then
    report the version "not published in time"). The trainer's sidecar is up and never
    publishes: only the check can end this receiver before the timeout."""
    t, a = hosts(2)
    wrong = f"127.0.0.1:{free_port()}"
    p = subprocess.run(
        [sys.executable, "-m", "tpusync.weights", "receive", f"--control-socket={a.control_socket}", f"--host={wrong}",
         "--model=m", "--version=1", f"--source={t.address}", f"--destination={wrong}", "--timeout-seconds=600"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 1, p.stderr
    assert p.stderr == (f"python -m tpusync.weights: error: {wrong} (this host's address) cannot be reached from "
                        f"this host's sidecar: peer: connect {wrong}: Connection refused\n")
