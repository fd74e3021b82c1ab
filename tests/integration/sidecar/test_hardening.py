"""Issue 14 against real sidecar processes: acknowledged writes, connection budgets, probes
under attack, pins, the control socket path, drain, and log lines. Attackers connect from
other loopback addresses (127.0.0.2...), legitimate clients from 127.0.0.1."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import threading

import numpy as np
import pytest

import tpusync
from tests.integration.conftest import BLOCK, SECRET, engine
from tpusync.errors import PreconditionError
from tpusync.local import sidecars as sidecar_mod

from .wire import ERROR, HELLO, WireClient, frame


def idle_connections(port: int, sources: list[str], per_source: int) -> list[socket.socket]:
    """Opens TCP connections that send nothing, from each source address."""
    held = []
    for src in sources:
        for _ in range(per_source):
            s = socket.socket()
            s.bind((src, 0))
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
    return held


def healthz(port: int) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/healthz")
    resp = conn.getresponse()
    return resp.status, resp.read()


def test_idle_unauthenticated_connections_do_not_lock_out_peers(launch):
    a = launch("a")
    data = {k: np.full(BLOCK, k, np.uint8) for k in range(1, 5)}
    engine(a).put(list(data), list(data.values()))
    # More idle connections than --max-connections (256), from a handful of addresses.
    attackers = idle_connections(a.data_port, [f"127.0.0.{i}" for i in range(2, 12)], 30)
    try:
        ok = 0
        for _ in range(40):
            with tpusync.KVStore.connect(f"tpusync://127.0.0.1:{a.data_port}", secret=SECRET) as peer:
                ok += peer.lookup(list(data))[0] == 4
        assert ok == 40
    finally:
        for s in attackers:
            s.close()


def test_healthz_stays_http_under_idle_connections(launch):
    a = launch("a")
    attackers = idle_connections(a.http_port, [f"127.0.0.{i}" for i in range(2, 12)], 16)
    try:
        for _ in range(5):
            assert healthz(a.http_port) == (200, b"ok\n")
    finally:
        for s in attackers:
            s.close()


def test_put_over_the_control_socket_never_acknowledges_a_write_it_did_not_make(launch):
    a = launch("a")
    holder, writer = engine(a), engine(a)
    block = np.arange(BLOCK, dtype=np.uint8)
    done: list[BaseException | None] = []

    def put() -> None:
        try:
            writer.put([7], [block])
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            done.append(e)

    with holder.reserve_many([7]) as slots:  # another engine holds the key's slot, uncommitted
        assert slots[0] is not None
        t = threading.Thread(target=put)
        t.start()
    t.join(30)  # the holder gave its slot back without committing
    assert done == [None]
    out = np.zeros(BLOCK, np.uint8)
    assert writer.get([7], [out]) == [True]
    np.testing.assert_array_equal(out, block)


def test_release_for_the_host_cannot_drop_another_connections_pin(launch):
    a = launch("a")
    e1, e2 = engine(a), engine(a)
    e1.put([3], [np.ones(BLOCK, np.uint8)])
    e1.pin([3])
    with pytest.raises(PreconditionError, match="not pinned by the host"):
        e2.release([3], for_host=True)
    assert e1.stats()["pinned"] == 1
    e1.release([3])  # e1's own pin is still there to release
    assert e1.stats()["pinned"] == 0


def test_control_socket_path_holding_a_file_is_refused_not_deleted(tmp_path, secret_file):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    pool = f"/dev/shm/tpusync-it-file-{id(precious)}"
    try:
        with pytest.raises(tpusync.errors.UnavailableError):
            sidecar_mod.launch(pool_path=pool, secret_file=secret_file, dram_bytes=4 * BLOCK, block_bytes=BLOCK,
                               control_socket=str(precious), stderr=subprocess.DEVNULL)
    finally:
        if os.path.exists(pool):
            os.unlink(pool)
    assert precious.read_text() == "keep me"


def test_a_draining_sidecar_refuses_new_connections(launch):
    a = launch("a")
    held = WireClient(a.data_port)  # an idle, authenticated connection keeps the drain going
    held.handshake(SECRET)
    a.process.send_signal(signal.SIGTERM)
    # Once the data port stops accepting, a new connection is refused, never left hanging.
    refused = False
    for _ in range(1000):
        try:
            socket.create_connection(("127.0.0.1", a.data_port), timeout=1).close()
        except (ConnectionRefusedError, ConnectionResetError):  # refused, or reset from the closed backlog
            refused = True
            break
    assert refused
    assert a.process.wait(60) == 0


def test_peer_text_cannot_forge_log_lines(launch, tmp_path):
    log = tmp_path / "a.log"
    with open(log, "w") as f:
        a = launch("a", stderr=f)
        c = WireClient(a.data_port)
        forged = b'x"\nts=0 level=error component=data msg="forged'
        c.send(frame(ERROR, forged))  # an unauthenticated peer's "error" in place of HELLO
        c.closed_by_peer()
        for _ in range(3):  # repeated refusals from one address are logged once
            w = WireClient(a.data_port)
            w.send(frame(HELLO, b"\0" * 31))
            w.closed_by_peer()
        a.process.send_signal(signal.SIGTERM)
        assert a.process.wait(60) == 0
    lines = log.read_text().splitlines()
    assert not any(line.startswith("ts=0 ") for line in lines), lines
    refusals = [line for line in lines if "handshake from 127.0.0.1 refused" in line]
    assert len(refusals) == 1, refusals
    assert "\\x0a" in refusals[0] and '\\"' in refusals[0]


def test_reserving_a_batch_waits_for_write_behind_to_make_room(launch, tmp_path):
    """A batch of reservations larger than DRAM's free slots, on a sidecar whose DRAM is full of
    blocks still to be written to disk: each slot is had once write-behind frees one (the
    reservations the batch already holds never wait for others' leases)."""
    s = launch("wb", dram_bytes=8 * BLOCK, disk_dir=str(tmp_path / "disk"), disk_bytes=64 * BLOCK)
    store = engine(s)
    data = {k: np.full(BLOCK, k, np.uint8) for k in range(1, 25)}
    for first in (1, 9, 17):  # three batches of a whole DRAM each
        keys = list(range(first, first + 8))
        with store.reserve_many(keys) as slots:
            for k, slot in zip(keys, slots):
                np.frombuffer(slot.view, np.uint8, BLOCK)[:] = data[k]
                slot.commit(BLOCK)
    out = [np.zeros(BLOCK, np.uint8) for _ in data]
    assert store.get(list(data), out) == [True] * len(data)
    assert all((o == v).all() for o, v in zip(out, data.values()))
