"""Wire protocol v2 against real sidecar processes on loopback: what v1 let a peer do that v2
refuses (a relayed handshake, requests that pick the cache's source, one source taking every
connection, stalled peers holding leases, mismatched block sizes, a pool file others can open,
plaintext on the wire), and what v2 reports that v1 did not.

Each test would fail on the v1 sidecar; where the reason is not plain from the assertions, a
comment says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest

import tpusync
from harness.polling import wait_for
from tests.integration.conftest import BLOCK, SECRET, engine
from tpusync import Tier
from tpusync.errors import CapacityError, InvalidArgumentError, PreconditionError, TpuSyncError, UnavailableError

from .netfault import Relay
from .support import assert_holds, blocks, metric
from .wire import (
    AUTH_OK,
    CHALLENGE,
    END,
    ERROR,
    EXISTS,
    HEADER,
    HELLO,
    MAGIC,
    PULL,
    PUSH,
    TIERS,
    VERSION,
    Session,
    WireClient,
    frame,
    keys_body,
)
from .wire import BLOCK as BLOCK_OP

FAILED_PRECONDITION, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED = 3, 4, 8  # tpusync::StatusCode, ERROR's status


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def read_plain_frame(sock: socket.socket) -> bytes:
    """One handshake frame (header and body, unsealed), as bytes to relay verbatim."""
    header = recv_exact(sock, HEADER.size)
    return header + recv_exact(sock, HEADER.unpack(header)[6])


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes (a reset after its last bytes counts as closed)."""
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def unsealed_frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(op, status, body) of each frame of an authenticated-only session's byte stream, read
    without its key: such a session's bodies are plaintext, followed by a 16-byte tag."""
    frames, off = [], 0
    while off < len(data):
        magic, version, op, status, _, _, n, _ = HEADER.unpack_from(data, off)
        assert (magic, version) == (MAGIC, VERSION), data[off:off + 64]
        frames.append((op, status, data[off + HEADER.size:off + HEADER.size + n]))
        off += HEADER.size + n + 16
    assert off == len(data), "trailing bytes after the last frame"
    return frames


# -- a. a relayed handshake -----------------------------------------------------------------

@pytest.mark.parametrize("request_kind", ["pull", "push"])
@pytest.mark.parametrize("forgery", ["plain frame", "forged tag"])
def test_a_relayed_handshake_gives_the_relay_nothing(launch, request_kind, forgery):
    """An attacker without the secret, listening on an address B takes for a member, relays B's
    handshake to A verbatim: A admits the connection (the proofs are B's and A's), so in v1,
    whose frames after AUTH_OK carried nothing but a checksum anyone can compute, the attacker
    then owned an authenticated connection to A: it pulled A's blocks and planted its own. In
    v2 every frame after AUTH_OK is sealed with a key derived from the secret and the
    transcript; the attacker's frames, plain or sealed under any key it can make, are refused."""
    a = launch("a")
    data = {k: np.full(BLOCK, 0x5A, np.uint8) for k in range(1, 5)}
    engine(a).put(list(data), list(data.values()))
    attacker = socket.create_server(("127.0.0.1", 0))
    attacker.settimeout(30)
    attacker_address = f"127.0.0.1:{attacker.getsockname()[1]}"
    b = launch("b", streams=1, peers=[attacker_address])  # as if the attacker held a member's address
    pulled: list[BaseException] = []

    def b_pulls() -> None:
        try:
            engine(b).read_remote(attacker_address, list(data))
        except TpuSyncError as e:
            pulled.append(e)

    t = threading.Thread(target=b_pulls)
    t.start()
    from_b, _ = attacker.accept()
    from_b.settimeout(10)
    to_a = socket.create_connection(("127.0.0.1", a.data_port), timeout=10)
    try:
        hello = read_plain_frame(from_b)
        to_a.sendall(hello)
        challenge = read_plain_frame(to_a)
        assert HEADER.unpack_from(challenge)[2] == CHALLENGE
        from_b.sendall(challenge)
        to_a.sendall(read_plain_frame(from_b))  # B's AUTH
        auth_ok = read_plain_frame(to_a)
        assert HEADER.unpack_from(auth_ok)[2] == AUTH_OK, auth_ok  # A admitted the relayed connection
        from_b.sendall(auth_ok)

        keys = list(data) if request_kind == "pull" else [666]
        op = PULL if request_kind == "pull" else PUSH
        if forgery == "plain frame":  # what worked in v1
            request = frame(op, keys_body(keys), count=len(keys))
        else:  # the transcript is public, the secret is not: the best key the attacker can derive
            transcript = hello[HEADER.size:] + challenge[HEADER.size:]
            guess = hmac.new(b"attacker's guess at the secret", b"tpusync/3 key client->server" + transcript,
                             hashlib.sha256).digest()
            header = HEADER.pack(MAGIC, VERSION, op, 0, 0, len(keys), 16 * len(keys), 0)
            request = Session(guess, encrypt=False).seal(header, keys_body(keys))
        to_a.sendall(request)
        header = recv_exact(to_a, HEADER.size)  # A's answer: one frame (body, then a 16-byte tag)
        reply = header + recv_exact(to_a, HEADER.unpack(header)[6] + 16)
        if request_kind == "push":
            # The block to plant, sent whatever A answered (in v1: TIERS asking for it). A v1
            # sidecar would store it: its BLOCK frames carried an XXH3 trailer anyone computes.
            planted = bytes([0x66]) * 4096
            with contextlib.suppress(OSError):
                to_a.sendall(HEADER.pack(MAGIC, VERSION, BLOCK_OP, 0, 0, 0, len(planted), 0) + planted + bytes(16)
                             + frame(END))
        reply += read_until_closed(to_a)
    finally:
        from_b.close()
        to_a.close()
        attacker.close()
    t.join(60)
    assert not t.is_alive()
    # A answered one ERROR (sealed for B's session, whose bodies are readable) and closed.
    [(reply_op, _, reason)] = unsealed_frames(reply)
    assert reply_op == ERROR, reply
    want = b"authentication tag mismatch" if forgery == "forged tag" else b"body_sum must be 0 in a sealed session"
    assert want in reason, reason
    assert bytes([0x5A]) * 64 not in reply  # no block bytes
    assert metric(a, "tpusync_bad_frames_total") == 1
    assert metric(a, "tpusync_transfer_blocks_total", direction="out", op="pull", tier="dram") == 0
    assert metric(a, "tpusync_transfer_blocks_total", direction="in", op="push", tier="dram") == 0
    ea = engine(a)
    assert ea.lookup([666]).prefix_len == 0  # nothing planted
    assert ea.stats()["blocks"] == len(data)
    assert len(pulled) == 1  # B's own pull failed (the attacker never served it), and B holds nothing
    assert engine(b).lookup(list(data)).prefix_len == 0


# -- b. a request cannot choose where the cache comes from ---------------------------------

def test_a_request_cannot_point_the_sidecar_at_a_non_member(launch):
    member = launch("member")
    data = blocks(0, 4)
    engine(member).put(list(data), list(data.values()))
    stranger = socket.create_server(("127.0.0.1", 0))  # a port on the member's host, not a member
    stranger_address = f"127.0.0.1:{stranger.getsockname()[1]}"
    other = launch("other")  # a real sidecar too, also not listed
    s = launch("s", peers=[f"127.0.0.1:{member.data_port}"])
    es = engine(s)
    es.put([100], [blocks(100, 1)[100]])
    try:
        for target in (stranger_address, other.address):
            for call, keys in ((es.read_remote, list(data)), (es.push_remote, [100]), (es.exists_remote, list(data))):
                with pytest.raises(PreconditionError, match=f"peer {re.escape(target)} is not a member of this pool"):
                    call(target, keys)
        # Refused before any connection attempt: the listener saw nobody (a dial would have
        # completed its TCP handshake before the call returned).
        stranger.settimeout(0.2)
        with pytest.raises(TimeoutError):
            stranger.accept()
    finally:
        stranger.close()
    assert metric(other, "tpusync_connections_total") == 0
    assert es.lookup(list(data)).prefix_len == 0
    # The member still serves, all three ways.
    assert es.exists_remote(member.address, list(data)) == [True] * 4
    assert es.read_remote(member.address, list(data)) == [True] * 4
    assert_holds(es, data)
    assert es.push_remote(member.address, [100]) == [True]
    assert engine(member).lookup([100]).prefix_len == 1


# -- c. per-source budget of admitted connections ------------------------------------------

def test_admitted_connections_are_budgeted_per_source(launch):
    """v1 had one budget of admitted connections for all sources: one peer holding
    --max-connections idle authenticated connections locked every other peer out."""
    a = launch("a", extra=["--max-connections=8", "--max-connections-per-source=4"])
    held = [WireClient(a.data_port) for _ in range(4)]
    for w in held:
        w.handshake(SECRET)
    fifth = WireClient(a.data_port)  # authenticated, then refused in place of AUTH_OK
    body = fifth.handshake(SECRET, expect=ERROR)
    assert fifth.status == RESOURCE_EXHAUSTED and b"connections from 127.0.0.1, the most one source may have" in body, (
        fifth.status, body)
    assert fifth.closed_by_peer()
    with pytest.raises(CapacityError, match="the most one source may have"):
        tpusync.KVStore.connect(f"tpusync://127.0.0.1:{a.data_port}", secret=SECRET, streams=1)
    assert metric(a, "tpusync_connections_refused_total") == 2
    # Another source is admitted meanwhile: 4 of the 8 are still free.
    others = [WireClient(a.data_port, source="127.0.0.2") for _ in range(2)]
    for w in others:
        w.handshake(SECRET)
    for w in others + held:  # and every admitted connection is served
        w.send_frame(EXISTS, keys_body([1]), count=1)
        op, _, count, tiers = w.recv_frame()
        assert (op, count, tiers) == (TIERS, 1, b"\x00")
    # A connection that closes gives its source's slot back.
    held.pop().sock.close()

    def admitted_again() -> bool:
        with tpusync.KVStore.connect(f"tpusync://127.0.0.1:{a.data_port}", secret=SECRET, streams=1) as peer:
            return peer.lookup([1]).prefix_len == 0

    wait_for("127.0.0.1's fourth slot to come back", admitted_again, timeout=15)


# -- d. stalled peers ------------------------------------------------------------------------

def test_a_reader_that_stops_reading_is_cut_and_its_lease_released(launch):
    """A PULL whose reader never reads: the block's frame cannot be sent whole within
    --progress-timeout-ms, so the connection is cut and the block's read lease goes with it.
    v1 waited for the request's deadline (120 s), holding the lease: evict and re-put failed
    all that while."""
    big = 8 << 20  # more than the sender's send buffer (tcp_wmem max 4 MiB) and the reader's window
    a = launch("a", block_bytes=big, dram_bytes=4 * big, extra=["--progress-timeout-ms=500"])
    ea = engine(a)
    ea.put([1], [np.full(big, 1, np.uint8)])
    w = WireClient(a.data_port, rcvbuf=4096)
    w.handshake(SECRET)
    w.send_frame(PULL, keys_body([1]), count=1)
    op, _, _, tiers = w.recv_frame()
    assert (op, tiers) == (TIERS, b"\x01")
    # The BLOCK header goes out with the first bytes of the payload: the sidecar holds the
    # block's read lease from here on. The reader reads nothing more.
    _, _, op, status, _, _, body_len, _ = HEADER.unpack(w.recv_exact(HEADER.size))
    assert (op, status, body_len) == (BLOCK_OP, 0, big)
    stalled = time.monotonic()
    with pytest.raises(PreconditionError, match="being read"):
        ea.evict([1])

    def evicted() -> bool:
        ea.evict([1])  # raises while the lease is held
        return True

    wait_for("the stalled reader's read lease to be released", evicted, timeout=20)
    assert time.monotonic() - stalled < 30  # the progress timeout, well before the 120 s op deadline
    assert ea.lookup([1]).prefix_len == 0
    fresh = np.full(big, 2, np.uint8)
    ea.put([1], [fresh])
    out = np.zeros(big, np.uint8)
    assert ea.get([1], [out]) == [True] and (out == 2).all()
    assert metric(a, "tpusync_deadline_exceeded_total") == 1
    w.sock.settimeout(30)
    got = w.recv_exact(4096)  # what was buffered still drains, and then the connection is closed
    assert got[:64] == bytes([1]) * 64
    read_until_closed(w.sock)


def server_rx_queue(data_port: int, client_port: int) -> int:
    """Bytes the sidecar has not yet read from our connection (its socket's receive queue)."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local, remote = fields[1].split(":")[1], fields[2].split(":")[1]
            if int(local, 16) == data_port and int(remote, 16) == client_port:
                return int(fields[4].split(":")[1], 16)
    raise LookupError(f"no connection {client_port} -> {data_port}")


def test_a_push_that_stalls_after_a_block_header_holds_no_slot(launch):
    """v1 reserved the block's slot as soon as a BLOCK header arrived, and kept it while the
    pusher sent nothing (until the 120 s deadline): an engine's put of the same key waited 10 s
    for that reservation and failed. v2 reserves once payload bytes arrive, and cuts a pusher
    that sends nothing within --progress-timeout-ms."""
    a = launch("a", extra=["--progress-timeout-ms=3000"])
    ea = engine(a)
    w = WireClient(a.data_port)
    w.handshake(SECRET)
    w.send_frame(PUSH, keys_body([5]), count=1)
    op, _, _, wanted = w.recv_frame()
    assert (op, wanted) == (TIERS, b"\x01")
    w.send(HEADER.pack(MAGIC, VERSION, BLOCK_OP, 0, 0, 0, BLOCK, 0))  # a sealed BLOCK's header, then nothing
    client_port = w.sock.getsockname()[1]
    wait_for("the sidecar to read the BLOCK header", lambda: server_rx_queue(a.data_port, client_port) == 0,
             timeout=10, interval=0.01)
    block = np.arange(BLOCK, dtype=np.uint32).astype(np.uint8)
    ea.put([5], [block])  # neither waits for the stalled pusher nor is refused
    # ...and did not wait for the pusher's cut either: its connection is still open, silent.
    assert select.select([w.sock], [], [], 0)[0] == []
    assert_holds(ea, {5: block})
    op, status, _, body = w.recv_frame()  # after the progress timeout: told why, and closed
    assert op == ERROR and status == DEADLINE_EXCEEDED, (status, body)
    assert b"no payload within the progress timeout after a BLOCK header" in body, body
    assert w.closed_by_peer()
    assert metric(a, "tpusync_deadline_exceeded_total") == 1
    assert ea.stats()["dram_used"] == 1
    assert_holds(ea, {5: block})


# -- e. block sizes ----------------------------------------------------------------------------

def test_a_sidecar_of_a_role_on_its_own_pool_pulls_from_the_other_pools_members_only(launch):
    """The flags the operator renders for a serving whose roles run on two pools: the decode
    sidecar's own pool by --peers-dns (members at its own data port) and the prefill pool by
    --peers=<its headless Service>:<its data port>, both DNS names. It pulls from the prefill
    pool's member and still refuses a sidecar of neither pool."""
    prefill = launch("prefill", peers=["localhost"])
    data = blocks(0, 4)
    engine(prefill).put(list(data), list(data.values()))
    with socket.create_server(("127.0.0.1", 0)) as probe:        # a fixed port: --peers-dns names members at it
        own_port = probe.getsockname()[1]
    decode = launch("decode", data_port=own_port, peers=[f"localhost:{prefill.data_port}"],
                    extra=["--peers-dns=localhost"])
    other = launch("other")
    ed = engine(decode)
    with pytest.raises(PreconditionError, match=f"peer {re.escape(other.address)} is not a member of this pool"):
        ed.read_remote(other.address, list(data))
    assert ed.read_remote(prefill.address, list(data)) == [True] * 4
    assert_holds(ed, data)
    assert metric(other, "tpusync_connections_total") == 0


def test_members_with_different_block_sizes_refuse_each_other(launch):
    """v1 never compared block sizes: a pull between differently configured members stored
    what fit, and refused the rest block by block with an error naming neither size."""
    a = launch("a")  # BLOCK
    b = launch("b", block_bytes=2 * BLOCK)
    data = blocks(0, 4)
    engine(a).put(list(data), list(data.values()))
    eb = engine(b)
    with pytest.raises(PreconditionError) as e:
        eb.read_remote(a.address, list(data))
    assert f"{BLOCK}-byte blocks" in str(e.value) and f"{2 * BLOCK}-byte blocks" in str(e.value), e.value
    assert eb.lookup(list(data)).prefix_len == 0 and eb.stats()["dram_used"] == 0
    ea = engine(a)
    ea.put([50], [blocks(50, 1)[50]])
    with pytest.raises(PreconditionError, match=f"{BLOCK}-byte blocks"):
        ea.push_remote(b.address, [50])  # the other way round too
    assert eb.lookup([50]).prefix_len == 0
    # The handshake refuses it on the HELLO, naming both sizes.
    w = WireClient(a.data_port)
    body = w.handshake(SECRET, block_bytes=2 * BLOCK, expect=ERROR)
    assert w.status == FAILED_PRECONDITION, (w.status, body)
    assert f"{BLOCK}-byte".encode() in body and f"{2 * BLOCK}-byte".encode() in body, body
    assert w.closed_by_peer()
    for size in (0, BLOCK):  # 0: any size (a client without a pool); the same size
        ok = WireClient(a.data_port)
        ok.handshake(SECRET, block_bytes=size)
        ok.send_frame(EXISTS, keys_body([0]), count=1)
        assert ok.recv_frame()[3] == b"\x01"


@pytest.mark.parametrize("path", ["control socket", "data port"])
def test_a_short_block_is_a_miss_in_a_full_size_buffer(launch, path):
    """v1 copied a short block into the front of a larger buffer and reported it found, the
    buffer's tail left as it was (stale bytes of another block, read as this one's)."""
    a = launch("a")
    short = blocks(3, 1, size=BLOCK - 4096)[3]
    engine(a).put([3], [short])
    store = engine(a) if path == "control socket" else tpusync.KVStore.connect(
        f"tpusync://{a.address}", secret=SECRET)
    full = np.full(BLOCK, 0xAA, np.uint8)
    assert store.get([3], [full]) == [False]
    assert (full == 0xAA).all()  # not written into either
    exact = np.zeros(short.size, np.uint8)
    assert store.get([3], [exact]) == [True]
    assert np.array_equal(exact, short)
    with pytest.raises(InvalidArgumentError):  # a buffer smaller than the block is still an error
        store.get([3], [np.zeros(100, np.uint8)])


# -- f. the pool file ------------------------------------------------------------------------

@pytest.mark.parametrize(("mode", "uid", "says"), [
    (0o666, None, "mode 0666"),
    (0o640, None, "mode 0640"),
    (0o600, 12345, "owned by uid 12345"),
])
def test_a_pool_file_others_can_open_is_refused(launch, tmp_path, mode, uid, says):
    """v1 opened whatever file was at --pool-path and mapped it: a pool file pre-created by
    someone else (or left world-readable) let them read and write every block."""
    pool = tmp_path / "pool"
    os.close(os.open(pool, os.O_CREAT | os.O_WRONLY, 0o600))
    os.chmod(pool, mode)
    if uid is not None:
        os.chown(pool, uid, -1)
    log = tmp_path / "stderr"
    with open(log, "w") as f, pytest.raises(UnavailableError, match=r"exited with [1-9]"):
        launch("p", pool_path=str(pool), stderr=f)
    text = log.read_text()
    assert says in text, text
    assert "remove the file, or chown and chmod 600 it" in text, text
    st = pool.stat()
    assert st.st_size == 0 and st.st_mode & 0o777 == mode  # not initialised, not changed


def test_a_symlink_as_pool_path_is_refused(launch, tmp_path):
    """v1 followed the link and initialised (truncated, mapped) whatever file it pointed to."""
    target = tmp_path / "victim"
    os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o600))
    link = tmp_path / "pool-link"
    link.symlink_to(target)
    log = tmp_path / "stderr"
    with open(log, "w") as f, pytest.raises(UnavailableError, match=r"exited with [1-9]"):
        launch("p", pool_path=str(link), stderr=f)
    assert "is a symbolic link; point --pool-path at the file itself" in log.read_text()
    assert target.stat().st_size == 0 and link.is_symlink()


# -- g. stats() through the sidecar ----------------------------------------------------------

def pool_tuning(s, disk_dir: str | None) -> dict[str, bool]:
    """What the sidecar process actually got, read from /proc: VM_HUGEPAGE on a mapping of the
    pool file, locked memory, O_DIRECT on the disk tier's extent file."""
    pid = s.process.pid
    hugepages, in_pool = False, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                in_pool = line.rstrip().endswith(s.pool_path)
            elif line.startswith("VmFlags:") and in_pool:
                hugepages |= "hg" in line.split()[1:]
    with open(f"/proc/{pid}/status") as f:
        locked_kb = next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))
    direct_io = False
    if disk_dir is not None:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == os.path.join(disk_dir, "extents.dat"):
                    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                        flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
                    direct_io |= bool(flags & os.O_DIRECT)
    return {"hugepages": hugepages, "mlocked": locked_kb > 0, "direct_io": direct_io}


def test_stats_through_the_sidecar_report_its_stores_tuning_and_last_error(launch, tmp_path):
    """v1's STATS reply had no hugepages, mlocked, direct_io or last_error: through the sidecar
    stats() lacked them (or showed a default), whatever the sidecar's store had."""
    disk = str(tmp_path / "disk")
    tuned = launch("tuned", dram_bytes=8 * BLOCK, disk_dir=disk, disk_bytes=16 * BLOCK,
                   extra=["--hugepages", "--mlock"])
    plain = launch("plain", dram_bytes=8 * BLOCK)
    for s, d in ((tuned, disk), (plain, None)):
        st = engine(s).stats()
        got = {k: st[k] for k in ("hugepages", "mlocked", "direct_io")}
        assert all(isinstance(v, bool) for v in got.values()), got
        assert got == pool_tuning(s, d), (s.args, got)
    st = engine(plain).stats()
    assert {k: st[k] for k in ("hugepages", "mlocked", "direct_io", "last_error")} == {
        "hugepages": False, "mlocked": False, "direct_io": False, "last_error": ""}
    assert engine(tuned).stats()["direct_io"]  # ext4 under the test's tmp_path takes O_DIRECT
    # last_error: a disk block that fails its checksum, as the sidecar's store reports it.
    et = engine(tuned)
    et.put([1], [np.full(BLOCK, 9, np.uint8)])
    et.evict([1])
    assert et.lookup([1]).tiers[0] == Tier.DISK
    with open(os.path.join(disk, "extents.dat"), "r+b") as f:  # one bit flipped in the payload
        f.seek(4096 + 1000)
        byte = f.read(1)[0]
        f.seek(4096 + 1000)
        f.write(bytes([byte ^ 0x10]))
    assert et.get([1], [np.zeros(BLOCK, np.uint8)]) == [False]
    st = et.stats()
    assert "checksum mismatch" in st["last_error"], st
    assert st["corruptions"] == metric(tuned, "tpusync_corruptions_total") == 1
    assert engine(plain).stats()["last_error"] == ""


# -- h. encryption -----------------------------------------------------------------------------

MARKER = b"<<tpusync plaintext marker>>"


def marked(first: int, n: int) -> dict[int, np.ndarray]:
    """Blocks of a distinctive, recognisable pattern (the key, then the marker, repeated)."""
    out = {}
    for k in range(first, first + n):
        unit = struct.pack("<Q", k) + MARKER
        out[k] = np.frombuffer((unit * (BLOCK // len(unit) + 1))[:BLOCK], np.uint8).copy()
    return out


@pytest.mark.parametrize("encrypting", ["both", "server", "client", "neither"])
def test_encrypted_sessions_hide_the_blocks_on_the_wire(launch, encrypting):
    """A wiretap between two sidecars (a recording relay) sees the blocks of a pull and a push
    in plaintext on an authenticated-only session, and never in an encrypted one: the server's
    --encrypt encrypts every session, the client's (its HELLO asks) its own. v1 had no
    encryption: the marker was on the wire every time."""
    server_flags = ["--encrypt"] if encrypting in ("both", "server") else []
    client_flags = ["--encrypt"] if encrypting in ("both", "client") else []
    a = launch("a", extra=server_flags)
    b = launch("b", extra=client_flags)
    data, more = marked(0, 8), marked(100, 4)
    engine(a).put(list(data), list(data.values()))
    relay = Relay(a.data_port, record=True)
    try:
        eb = engine(b)
        assert eb.read_remote(relay.address, list(data)) == [True] * 8
        assert_holds(eb, data)  # byte-exact
        eb.put(list(more), list(more.values()))
        assert eb.push_remote(relay.address, list(more)) == [True] * 4
        assert_holds(engine(a), more)
    finally:
        relay.close()
    down, up = bytes(relay.downstream), bytes(relay.upstream)
    assert len(down) > 8 * BLOCK and len(up) > 4 * BLOCK  # the blocks did cross the relay
    if encrypting == "neither":
        assert MARKER in down and MARKER in up
    else:
        assert MARKER not in down and MARKER not in up
        assert struct.pack("<Q", 3) + MARKER not in down


def test_clients_that_ask_for_encryption_get_it(launch, tmp_path):
    """KVStore.connect("tpusync://...", encrypt=True), KVStore.local(..., encrypt=True) and a
    wire client asking in its HELLO, against a sidecar that does not encrypt by itself."""
    a = launch("a")
    data = marked(0, 4)
    engine(a).put(list(data), list(data.values()))
    relay = Relay(a.data_port, record=True)
    try:
        remote = tpusync.KVStore.connect(f"tpusync://{relay.address}", secret=SECRET, encrypt=True)
        assert_holds(remote, data)
        with tpusync.KVStore.local(dram_bytes=8 * BLOCK, block_bytes=BLOCK, secret=SECRET, encrypt=True) as local:
            assert local.read_remote(relay.address, list(data)) == [True] * 4
            assert_holds(local, data)
        # The independent AEAD of wire.py opens what the sidecar sealed: the format is as documented.
        w = WireClient(relay.port)
        w.handshake(SECRET, encrypt=True)
        assert w.tx is not None and w.tx.encrypt and w.rx is not None and w.rx.encrypt
        w.send_frame(PULL, keys_body([2]), count=1)
        assert w.recv_frame()[::3] == (TIERS, b"\x01")
        op, status, index, payload = w.recv_frame()
        assert (op, status, index) == (BLOCK_OP, 0, 0) and payload == data[2].tobytes()
        assert w.recv_frame()[0] == END
    finally:
        relay.close()
    assert len(relay.downstream) > 9 * BLOCK
    assert MARKER not in bytes(relay.downstream)


# -- i. an older peer ---------------------------------------------------------------------------

@pytest.mark.parametrize("version", [1, 2])
def test_an_older_peer_is_told_which_versions_differ(launch, version):
    """Version 2 is the AES-256-GCM session of before AEGIS-128X2 (version 3): a sidecar of a
    pool half rolled out names both versions rather than failing on a tag."""
    a = launch("a")
    w = WireClient(a.data_port)
    w.send(frame(HELLO, os.urandom(32), version=version))  # what a v1 client sends first: a 32-byte nonce
    op, _, _, body = w.recv_frame()
    assert op == ERROR and f"protocol version {version}, this build speaks 3".encode() in body, body
    assert w.closed_by_peer()
    assert metric(a, "tpusync_auth_failures_total") == 1
