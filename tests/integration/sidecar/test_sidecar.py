"""Real tpusync-sidecar processes on 127.0.0.1 exchanging blocks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest

import tpusync
from tests.integration.conftest import BLOCK, SECRET, engine
from tpusync import Tier
from tpusync.errors import UnavailableError

from .netfault import Relay
from .support import assert_holds, blocks, metric
from .wire import BLOCK as BLOCK_OP
from .wire import ERROR, EXISTS, HEADER, HELLO, PULL, PUSH, TIERS, WireClient, frame, keys_body


def test_two_sidecars_pull_and_push_byte_exact(launch):
    a, b = launch("a"), launch("b")
    data = blocks(0, 24)
    engine(a).put(list(data), list(data.values()))

    held = engine(b).read_remote(a.address, list(data) + [999])
    assert held == [True] * 24 + [False]
    assert_holds(engine(b), data)
    assert metric(a, "tpusync_transfer_blocks_total", direction="out", op="pull", tier="dram") == 24

    more = blocks(100, 8, size=BLOCK - 1000)  # short blocks keep their length
    engine(b).put(list(more), list(more.values()))
    assert engine(b).push_remote(a.address, list(more)) == [True] * 8
    out = [np.zeros(BLOCK - 1000, np.uint8) for _ in more]
    assert all(engine(a).get(list(more), out))
    assert all(np.array_equal(o, m) for o, m in zip(out, more.values()))
    # A full-size buffer is not what they hold: a miss, never a buffer with a stale tail.
    assert engine(a).get(list(more), [np.zeros(BLOCK, np.uint8) for _ in more]) == [False] * 8


def test_three_sidecars_pull_only_the_missing_part_of_a_prefix(launch):
    a, b, c = launch("a"), launch("b"), launch("c")
    data = blocks(0, 32)
    engine(a).put(list(data), list(data.values()))
    engine(b).read_remote(a.address, list(data)[:20])  # b holds the first 20 blocks of the prefix
    sent_before = metric(b, "tpusync_transfer_blocks_total", direction="out", op="pull", tier="dram")
    engine(c).put(list(data)[:12], [data[k] for k in list(data)[:12]])  # c already has 12

    assert engine(c).read_remote(b.address, list(data)[:20]) == [True] * 20
    assert engine(c).read_remote(a.address, list(data)) == [True] * 32
    # Only what c lacked travelled: 8 blocks from b, then 12 from a.
    assert metric(b, "tpusync_transfer_blocks_total", direction="out", op="pull", tier="dram") - sent_before == 8
    assert metric(a, "tpusync_transfer_blocks_total", direction="out", op="pull", tier="dram") == 20 + 12
    assert_holds(engine(c), data)


def test_pull_from_a_disk_tier_peer(launch, tmp_path):
    a = launch("a", dram_bytes=4 * BLOCK, disk_dir=str(tmp_path / "disk"), disk_bytes=128 * BLOCK)
    b = launch("b")
    data = blocks(0, 40)
    ea = engine(a)
    ea.put(list(data), list(data.values()))
    ea.flush()
    assert (ea.lookup(list(data)).tiers == Tier.DISK).sum() > 30
    assert engine(b).read_remote(a.address, list(data)) == [True] * 40
    assert_holds(engine(b), data)
    assert metric(a, "tpusync_transfer_blocks_total", direction="out", op="pull", tier="disk") > 30


def test_killed_peer_mid_transfer(launch):
    a, b = launch("a"), launch("b")
    data = blocks(0, 64)
    engine(a).put(list(data), list(data.values()))
    relay = Relay(a.data_port)
    relay.hold(after_bytes=10 * BLOCK)  # let about ten blocks through, then freeze the stream
    errors: list[Exception] = []

    def pull() -> None:
        try:
            engine(b).read_remote(relay.address, list(data))
        except UnavailableError as e:
            errors.append(e)

    t = threading.Thread(target=pull)
    t.start()
    assert relay.reached.wait(30)
    a.kill()  # the peer dies with the transfer half done
    relay.close()
    t.join(60)
    # Through the sidecar as on the direct path: the call fails, and what arrived is kept.
    assert len(errors) == 1, "read_remote returned normally from a peer that died part-way"
    eb = engine(b)
    held = [bool(t != Tier.NONE) for t in eb.lookup(list(data)).tiers]
    assert 0 < sum(held) < 64, held
    assert f"{sum(held)} of 64 blocks held locally" in str(errors[0])
    assert_holds(eb, {k: v for (k, v), h in zip(data.items(), held) if h})  # each whole: nothing partial
    assert eb.stats()["dram_used"] == sum(held)  # no slot leaked by the aborted blocks
    # b keeps serving: a fresh peer still gets what b holds.
    c = launch("c")
    got = engine(c).read_remote(b.address, list(data))
    assert got == held


def test_blocks_are_readable_as_they_arrive(launch):
    """Layer-wise streaming: a receiver can read the first blocks of a pull (say, the first
    layers' KV, requested first) while the rest are still on the wire."""
    a, b = launch("a"), launch("b")
    data = blocks(0, 64)
    engine(a).put(list(data), list(data.values()))
    relay = Relay(a.data_port)
    relay.hold(after_bytes=10 * BLOCK)   # freeze the stream after about ten blocks
    reader = engine(b)                   # another engine in b's pod, while the pull is in flight
    cursor = reader.changes().cursor
    result: list[list[bool]] = []
    t = threading.Thread(target=lambda: result.append(engine(b).read_remote(relay.address, list(data))))
    t.start()
    assert relay.reached.wait(30)
    # The relay has forwarded the bytes; b commits each block as it lands, and says so in its
    # change feed.
    committed = reader.changes(cursor, wait_s=30)
    assert committed.keys and not committed.lost, committed
    present = [k for k, tier in zip(data, reader.lookup(list(data)).tiers) if tier != Tier.NONE]
    assert 0 < len(present) < 64, present
    assert_holds(reader, {k: data[k] for k in present})   # whole and byte-exact already
    relay.release()
    t.join(60)
    assert result == [[True] * 64]
    assert_holds(reader, data)


def test_restart_reattaches_pool_and_disk(launch, tmp_path):
    disk = str(tmp_path / "disk")
    a = launch("a", dram_bytes=8 * BLOCK, disk_dir=disk, disk_bytes=64 * BLOCK)
    data = blocks(0, 30)
    ea = engine(a)
    ea.put(list(data), list(data.values()))
    ea.flush()
    a.kill()
    a2 = launch("a2", pool_path=a.pool_path, dram_bytes=8 * BLOCK, disk_dir=disk, disk_bytes=64 * BLOCK)
    assert engine(a2).lookup(list(data)).prefix_len == 30
    b = launch("b")
    assert engine(b).read_remote(a2.address, list(data)) == [True] * 30
    assert_holds(engine(b), data)


def test_wrong_secret_is_refused_and_counted(launch):
    a = launch("a")
    with pytest.raises(tpusync.errors.AuthError, match="does not hold this pool's secret"):
        tpusync.KVStore.connect(f"tpusync://{a.address}", secret=b"not-the-secret-at-all")
    assert metric(a, "tpusync_auth_failures_total") == 1
    # Data before authentication is refused on its header: the body is never awaited, so
    # these headers, sent without the bodies they announce, get their answer at once.
    for header, reason in ((frame(PULL, count=1, body_len=16), b"expected HELLO"),
                           (frame(HELLO, body_len=32 << 20), b"HELLO body of 33554432 bytes")):
        w = WireClient(a.data_port)
        w.send(header)
        op, _status, _, body = w.recv_frame()
        assert op == ERROR and reason in body, body
        assert w.closed_by_peer()
    # The sidecar still serves authenticated peers.
    remote = tpusync.KVStore.connect(f"tpusync://{a.address}", secret=SECRET)
    remote.put([5], [blocks(5, 1)[5]])
    assert engine(a).lookup([5]).prefix_len == 1


def altered(sealed: bytes, at: int) -> bytes:
    """A sealed frame with one bit flipped at `at`, after its tag was computed."""
    return sealed[:at] + bytes([sealed[at] ^ 1]) + sealed[at + 1:]


def replayed(w: WireClient) -> bytes:
    """A frame the server accepted once, sent again: its tag was for an earlier frame counter."""
    sealed = w.sealed(EXISTS, keys_body([1]), count=1)
    w.send(sealed)
    assert w.recv_frame()[0] == TIERS
    return sealed


# After the handshake every frame is sealed: each bad frame below carries a valid tag (over
# the header as sent), so the rule it breaks is what refuses it, not the tag; "bad tag",
# "altered body", "replayed frame" and "plain frame" are frames this session's key and counter
# did not seal as they arrive (where v1 had "body checksum").
BAD_FRAMES: dict[str, tuple[Callable[[WireClient], bytes], bytes]] = {
    "wrong magic": (lambda w: w.sealed(EXISTS, keys_body([1]), count=1, magic=0x12345678), b"wrong magic"),
    "wrong version": (lambda w: w.sealed(EXISTS, keys_body([1]), count=1, version=7), b"protocol version 7"),
    "unknown op": (lambda w: w.sealed(999, b""), b"unknown op 999"),
    "bad tag": (lambda w: w.sealed(EXISTS, keys_body([1]), count=1, bad_tag=True), b"authentication tag mismatch"),
    "altered body": (lambda w: altered(w.sealed(EXISTS, keys_body([1]), count=1), HEADER.size),
                     b"authentication tag mismatch"),
    "replayed frame": (replayed, b"authentication tag mismatch"),
    "plain frame": (lambda w: frame(EXISTS, keys_body([1]), count=1), b"body_sum must be 0"),
    "count vs body": (lambda w: w.sealed(EXISTS, keys_body([1, 2]), count=3), b"declares 3 keys and 32 body bytes"),
    "huge body": (lambda w: w.sealed(EXISTS, b"", count=1, body_len=1 << 40), b"exceeds"),
    "reply op as request": (lambda w: w.sealed(TIERS, b"\x01", count=1), b"is not a request here"),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_malformed_frames_get_an_error_and_a_closed_connection(launch, name):
    a = launch("a")
    w = WireClient(a.data_port)
    w.handshake(SECRET)
    make, reason = BAD_FRAMES[name]
    w.send(make(w))
    op, _, _, body = w.recv_frame()  # the refusal itself is sealed, and opens with the session's key
    assert op == ERROR and b"bad frame" in body and reason in body, body
    assert w.closed_by_peer()
    assert metric(a, "tpusync_bad_frames_total") >= 1
    healthy = tpusync.KVStore.connect(f"tpusync://{a.address}", secret=SECRET)
    assert healthy.lookup([1]).prefix_len == 0


def test_push_with_a_corrupted_payload_stores_nothing(launch):
    a = launch("a")
    w = WireClient(a.data_port)
    w.handshake(SECRET)
    w.send_frame(PUSH, keys_body([7, 8]), count=2)
    op, _, _, wanted = w.recv_frame()
    assert op == TIERS and wanted == b"\x01\x01"
    payload = bytes(range(256)) * 16
    w.send_frame(BLOCK_OP, payload, count=0)
    w.send(altered(w.sealed(BLOCK_OP, payload, count=1), HEADER.size + 1000))  # one payload bit flipped on the way
    op, _, _, body = w.recv_frame()
    assert op == ERROR and b"authentication tag mismatch" in body, body
    ea = engine(a)
    assert list(ea.lookup([7, 8]).tiers) == [Tier.DRAM, Tier.NONE]
    assert ea.stats()["dram_used"] == 1  # the bad block's slot went back


def test_push_of_an_unannounced_block_is_refused(launch):
    a = launch("a")
    w = WireClient(a.data_port)
    w.handshake(SECRET)
    w.send_frame(PUSH, keys_body([7]), count=1)
    w.recv_frame()
    w.send_frame(BLOCK_OP, bytes(16), count=5)
    op, _, _, body = w.recv_frame()
    assert op == ERROR and b"was not asked for" in body
    assert engine(a).stats()["dram_used"] == 0


def test_many_concurrent_clients(launch):
    a = launch("a", dram_bytes=256 * BLOCK)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            mine = blocks(1000 * i, 8)
            via_socket = i % 2 == 0
            store = engine(a) if via_socket else tpusync.KVStore.connect(f"tpusync://{a.address}", secret=SECRET,
                                                                          streams=2)
            for _ in range(3):
                store.put(list(mine), list(mine.values()))
                assert_holds(store, mine)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert engine(a).stats()["blocks"] == 16 * 8


def test_connections_over_the_limit_are_refused_and_counted(launch):
    a = launch("a", extra=["--max-connections=2"])
    held = [WireClient(a.data_port) for _ in range(2)]
    for w in held:
        w.handshake(SECRET)
    extra = WireClient(a.data_port)       # authenticated, then told why and closed unserved
    body = extra.handshake(SECRET, expect=ERROR)
    assert b"at its connection limit" in body, body
    assert extra.closed_by_peer()
    # A real client reports it as the pool being out of capacity, not as a broken connection.
    with pytest.raises(tpusync.errors.CapacityError, match="connection limit"):
        tpusync.KVStore.connect(f"tpusync://127.0.0.1:{a.data_port}", secret=SECRET)
    assert metric(a, "tpusync_connections_refused_total") == 2
    for w in held:                        # the connections within the limit are still served
        w.send_frame(EXISTS, keys_body([1]), count=1)
        op, _, count, body = w.recv_frame()
        assert (op, count, body) == (TIERS, 1, b"\x00")


def test_pins_belong_to_the_connection_that_took_them(launch):
    """An engine that dies with pins held must not keep its blocks in DRAM forever, and one
    engine cannot drop another's pins."""
    a = launch("a")
    data = blocks(0, 4)
    e1, e2 = engine(a), engine(a)
    e1.put(list(data), list(data.values()))
    assert e1.lookup(list(data), pin=True).prefix_len == 4
    e1.pin([0])
    assert e2.stats()["pinned"] == 4
    with pytest.raises(tpusync.errors.PreconditionError, match="not pinned by this connection"):
        e2.release([0, 1])
    e1.release([0])                       # one of block 0's two pins
    with pytest.raises(tpusync.errors.PreconditionError, match="not pinned by this connection"):
        e1.release([1, 1])                # more than it holds: nothing is released
    assert e2.stats()["pinned"] == 4
    e1.close()                            # returns once the sidecar has dropped e1's pins
    assert e2.stats()["pinned"] == 0
    assert e2.lookup(list(data)).prefix_len == 4   # the blocks themselves stay
    # Pins for the host outlive the connection that took them; any client releases them.
    e3 = engine(a)
    e3.pin([2, 3], for_host=True)
    e3.close()
    e4 = engine(a)
    assert e4.stats()["pinned"] == 2
    with pytest.raises(tpusync.errors.PreconditionError, match="not pinned by this connection"):
        e4.release([2])                   # not a connection pin of e4's
    e4.release([2, 3], for_host=True)
    assert e4.stats()["pinned"] == 0


def test_sigterm_drains_an_in_flight_transfer(launch):
    # One stream, so the whole pull is one request that A is serving when SIGTERM arrives.
    a, b = launch("a"), launch("b", streams=1)
    data = blocks(0, 48)
    engine(a).put(list(data), list(data.values()))
    relay = Relay(a.data_port)
    relay.hold(after_bytes=4 * BLOCK)
    result: list[list[bool]] = []
    t = threading.Thread(target=lambda: result.append(engine(b).read_remote(relay.address, list(data))))
    t.start()
    assert relay.reached.wait(30)
    a.process.send_signal(signal.SIGTERM)  # the transfer is in flight: a must finish it before exiting
    with pytest.raises(OSError):  # not ready (503) while draining, then gone
        for _ in range(200):
            urllib.request.urlopen(f"http://127.0.0.1:{a.http_port}/readyz", timeout=1)
    relay.release()
    t.join(60)
    assert a.process.wait(60) == 0
    assert result[0] == [True] * 48
    assert_holds(engine(b), data)


def test_http_endpoints(launch):
    a = launch("a")
    base = f"http://127.0.0.1:{a.http_port}"
    assert urllib.request.urlopen(base + "/healthz").read() == b"ok\n"
    assert urllib.request.urlopen(base + "/readyz").read() == b"ready\n"
    b = launch("b", extra=["--peers-dns=pool-peers.ns.svc"])
    readyz = urllib.request.urlopen(f"http://127.0.0.1:{b.http_port}/readyz").read()
    assert readyz == b"ready\npeers pool-peers.ns.svc\n"
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    for name in ("tpusync_request_duration_seconds_bucket", "tpusync_pool_dram_slots", "tpusync_evictions_total",
                 "tpusync_corruptions_total", "tpusync_transfer_bytes_total"):
        assert name in text
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base + "/nope")
    assert e.value.code == 404
    raw = socket.create_connection(("127.0.0.1", a.http_port))
    raw.sendall(b"x" * 20000)  # an oversized request is dropped, the server keeps going
    raw.close()
    assert urllib.request.urlopen(base + "/healthz").read() == b"ok\n"


def test_sidecar_refuses_to_start_without_a_secret(tmp_path):
    from tpusync.local import sidecars as sidecar_mod

    with pytest.raises(tpusync.errors.UnavailableError, match="exited with 1"):
        sidecar_mod.launch(pool_path=f"/dev/shm/tpusync-nosecret-{tmp_path.name}", secret_file=str(tmp_path / "none"),
                           dram_bytes=4 * BLOCK, block_bytes=BLOCK)


def test_a_clean_stop_removes_the_control_socket_and_the_start_logs_the_tiers(launch, tmp_path):
    log = tmp_path / "sidecar.log"
    with open(log, "w") as err:
        s = launch("tiers", disk_dir=str(tmp_path / "disk"), disk_bytes=8 * BLOCK, stderr=err)
        assert os.path.exists(s.control_socket)
        assert s.stop() == 0
    assert not os.path.exists(s.control_socket)
    text = log.read_text()
    assert f"tiers: DRAM {64 << 20} bytes; disk {tmp_path / 'disk'} {8 * BLOCK} bytes; shared off" in text, text
    assert subprocess.run(s.args[:1] + ["--help"], capture_output=True).returncode == 0


@pytest.mark.parametrize("flag, message", [
    ("--dram-bytes=-1Gi", "--dram-bytes=-1Gi: a size cannot be negative"),
    ("--disk-bytes=1Gi", "--disk-bytes without --disk-dir: there is no disk tier to size"),
    ("--shared-policy=demote", "--shared-policy without --shared-dir: there is no shared tier"),
])
def test_flags_that_cannot_work_are_refused_with_one_line(secret_file, flag, message):
    from tpusync.local import sidecars as sidecar_mod

    done = subprocess.run([sidecar_mod.sidecar_binary(), "--block-bytes=4096", "--dram-bytes=1Mi", "--pool-path=/x",
                           f"--auth-secret-file={secret_file}", flag], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr == f"tpusync-sidecar: {message}\n", done.stderr


def test_a_secret_others_can_read_and_a_missing_disk_dir_are_refused(secret_file, tmp_path):
    from tpusync.local import sidecars as sidecar_mod

    base = [sidecar_mod.sidecar_binary(), "--block-bytes=4096", "--dram-bytes=1Mi",
            f"--pool-path=/dev/shm/tpusync-refused-{tmp_path.name}", "--data-port=0", "--http-port=0"]
    os.chmod(secret_file, 0o644)
    done = subprocess.run([*base, f"--auth-secret-file={secret_file}"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert f"auth secret file {secret_file} is open to other users (mode 0644): chmod 600 it" in done.stderr

    os.chmod(secret_file, 0o640)  # a group may share it (the operator mounts it 0440)
    missing = tmp_path / "no-such-ssd"
    done = subprocess.run([*base, f"--auth-secret-file={secret_file}", f"--disk-dir={missing}", "--disk-bytes=1Mi"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert f"--disk-dir={missing} is not a directory: mount the disk there, or pass --create-disk-dir" in done.stderr
    assert not missing.exists()


def test_the_change_feed_reports_evictions_as_they_happen(launch, tmp_path):
    """A watcher long-polling the sidecar learns of a block leaving DRAM at once: the write-behind
    of a full pool, which no engine call names, and a restart (lost)."""
    a = launch("a", dram_bytes=4 * BLOCK, disk_dir=str(tmp_path / "disk"), disk_bytes=64 * BLOCK)
    watcher, writer = engine(a), engine(a)
    cursor = watcher.changes().cursor
    got: list[tpusync.store.Changes] = []

    def watch() -> None:  # waits far longer than the test takes: the change ends the wait
        got.append(watcher.changes(cursor, wait_s=60))

    t = threading.Thread(target=watch)
    t.start()
    data = blocks(0, 12)
    writer.put(list(data), list(data.values()))
    t.join(timeout=30)
    assert not t.is_alive() and not got[0].lost and 0 in got[0].keys
    writer.flush()
    changed = set(got[0].keys)
    cursor = got[0].cursor
    while True:  # drain: what was recorded since, without waiting
        batch = watcher.changes(cursor)
        if not batch.keys:
            break
        changed |= set(batch.keys)
        cursor = batch.cursor
    on_disk = [k for k, tier in zip(data, writer.lookup(list(data)).tiers) if tier == Tier.DISK]
    assert on_disk and set(on_disk) <= changed   # every block written behind was reported
    a.kill()
    a2 = launch("a2", pool_path=a.pool_path, dram_bytes=4 * BLOCK, disk_dir=str(tmp_path / "disk"),
                disk_bytes=64 * BLOCK)
    assert engine(a2).changes(cursor).lost      # another sidecar's cursor: reread everything
