"""A minimal client of the tpusync wire protocol in Python, written from docs/wire-protocol.md,
to send what the C++ client never would: malformed frames, unannounced blocks, bad tags, a
relayed handshake. Its framing, nonces and key derivation are this file's own; AEGIS-128X2
and AEGIS-128X2-MAC come from pyaegis (libaegis's author's binding, built from its own sdist),
held like the sidecar's libaegis to the draft's test vectors (native/tests/session_test.cc).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

import xxhash
from pyaegis import Aegis128X2, AegisMac128X2

MAGIC, VERSION = 0x59535054, 3
HELLO, CHALLENGE, AUTH, AUTH_OK = 1, 2, 3, 4
EXISTS, TIERS, PULL, PUSH, PUSH_DONE, BLOCK, END = 10, 11, 12, 13, 14, 15, 16
ERROR = 61
HEADER = struct.Struct("<IHHHHIQQ")
FLAG_ENCRYPT = 1


def frame(op: int, body: bytes = b"", *, count: int = 0, status: int = 0, magic: int = MAGIC,
          version: int = VERSION, body_len: int | None = None, body_sum: int | None = None) -> bytes:
    """A plain (unsealed) frame, as the handshake sends them."""
    n = len(body) if body_len is None else body_len
    s = xxhash.xxh3_64_intdigest(body) if body_sum is None else body_sum
    return HEADER.pack(magic, version, op, status, 0, count, n, s) + body


def keys_body(keys: list[int]) -> bytes:
    return b"".join(struct.pack("<QQ", k >> 64, k & (2**64 - 1)) for k in keys)


def handshake_body(nonce: bytes, block_bytes: int = 0, flags: int = 0) -> bytes:
    return nonce + struct.pack("<QQ", block_bytes, flags)


def proof(secret: bytes, label: bytes, hello: bytes, challenge: bytes) -> bytes:
    return hmac.new(secret, b"tpusync/3 " + label + hello + challenge, hashlib.sha256).digest()


class Session:
    """One direction's key and frame counter: the nonce of frame n is n (8 bytes, little-endian),
    then eight zero bytes; tags are 16 bytes."""

    def __init__(self, key: bytes, encrypt: bool):
        self.key, self.encrypt, self.seq = key[:16], encrypt, 0

    def _nonce(self) -> bytes:
        nonce = struct.pack("<Q", self.seq) + b"\0" * 8
        self.seq += 1
        return nonce

    def seal(self, header: bytes, body: bytes) -> bytes:
        """header + (encrypted) body + tag."""
        if self.encrypt:
            return header + Aegis128X2(tag_size=16).encrypt(self.key, self._nonce(), body, header)
        mac = AegisMac128X2(self.key, self._nonce(), tag_size=16)
        mac.update(header + body)
        return header + body + mac.final()

    def open(self, header: bytes, body: bytes, tag: bytes) -> bytes:
        if self.encrypt:
            return Aegis128X2(tag_size=16).decrypt(self.key, self._nonce(), body + tag, header)
        mac = AegisMac128X2(self.key, self._nonce(), tag_size=16)
        mac.update(header + body)
        mac.verify(tag)  # raises pyaegis.DecryptionError on a bad tag
        return body


class WireClient:
    def __init__(self, port: int, host: str = "127.0.0.1", *, source: str | None = None, rcvbuf: int | None = None):
        """`source`: the local address to connect from (127.0.0.2... is another source on
        loopback); `rcvbuf`: SO_RCVBUF, set before connecting so the window stays that small."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        if source is not None:
            self.sock.bind((source, 0))
        self.sock.connect((host, port))
        self.tx: Session | None = None
        self.rx: Session | None = None
        self.status = 0  # the status field of the last frame handshake() received

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_frame(self, op: int, body: bytes = b"", *, count: int = 0, status: int = 0) -> None:
        """A frame sealed in this client's session (plain before the handshake)."""
        if self.tx is None:
            self.send(frame(op, body, count=count, status=status))
        else:
            self.send(self.tx.seal(HEADER.pack(MAGIC, VERSION, op, status, 0, count, len(body), 0), body))

    def sealed(self, op: int, body: bytes = b"", *, count: int = 0, status: int = 0, magic: int = MAGIC,
               version: int = VERSION, body_len: int | None = None, body_sum: int = 0,
               bad_tag: bool = False) -> bytes:
        """A frame sealed in this session whose header may break a rule (the tag covers the
        header as sent); `bad_tag` flips a bit of the tag. Uses up one frame of the counter."""
        assert self.tx is not None, "sealed() needs a completed handshake"
        n = len(body) if body_len is None else body_len
        out = self.tx.seal(HEADER.pack(magic, version, op, status, 0, count, n, body_sum), body)
        return out[:-1] + bytes([out[-1] ^ 1]) if bad_tag else out

    def recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    def recv_frame(self) -> tuple[int, int, int, bytes]:
        header = self.recv_exact(HEADER.size)
        magic, version, op, status, _, count, n, _ = HEADER.unpack(header)
        assert (magic, version) == (MAGIC, VERSION)
        body = self.recv_exact(n)
        if self.rx is not None:
            body = self.rx.open(header, body, self.recv_exact(16))
        return op, status, count, body

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def handshake(self, secret: bytes, *, expect: int = AUTH_OK, block_bytes: int = 0,
                  encrypt: bool = False) -> bytes:
        """Proves the secret and seals the session; returns the body of the server's last frame
        (`expect`)."""
        hello = handshake_body(os.urandom(32), block_bytes, FLAG_ENCRYPT if encrypt else 0)
        self.send(frame(HELLO, hello))
        op, self.status, _, challenge = self.recv_frame()
        if op != CHALLENGE:
            assert op == expect, (op, challenge)
            return challenge
        self.send(frame(AUTH, proof(secret, b"client proof", hello, challenge)))
        op, self.status, _, body = self.recv_frame()
        assert op == expect, (op, body)
        if op == AUTH_OK:
            assert hmac.compare_digest(body, proof(secret, b"server proof", hello, challenge))
            sealed = bool(struct.unpack_from("<Q", challenge, 40)[0] & FLAG_ENCRYPT)
            transcript = hello + challenge
            up = hmac.new(secret, b"tpusync/3 key client->server" + transcript, hashlib.sha256).digest()
            down = hmac.new(secret, b"tpusync/3 key server->client" + transcript, hashlib.sha256).digest()
            self.tx, self.rx = Session(up, sealed), Session(down, sealed)
        return body
