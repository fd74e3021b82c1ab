"""A minimal client of the tpusync wire protocol in Python, written from docs/wire-protocol.md,
to send what the C++ client never would: malformed frames, unannounced blocks, bad checksums.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

import xxhash

MAGIC, VERSION = 0x59535054, 1
HELLO, CHALLENGE, AUTH, AUTH_OK = 1, 2, 3, 4
EXISTS, TIERS, PULL, PUSH, PUSH_DONE, BLOCK, END = 10, 11, 12, 13, 14, 15, 16
ERROR = 61
HEADER = struct.Struct("<IHHHHIQQ")


def frame(op: int, body: bytes = b"", *, count: int = 0, status: int = 0, magic: int = MAGIC,
          version: int = VERSION, body_len: int | None = None, body_sum: int | None = None) -> bytes:
    n = len(body) if body_len is None else body_len
    s = xxhash.xxh3_64_intdigest(body) if body_sum is None else body_sum
    return HEADER.pack(magic, version, op, status, 0, count, n, s) + body


def keys_body(keys: list[int]) -> bytes:
    return b"".join(struct.pack("<QQ", k >> 64, k & (2**64 - 1)) for k in keys)


class WireClient:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    def recv_frame(self) -> tuple[int, int, int, bytes]:
        magic, version, op, status, _, count, n, _ = HEADER.unpack(self.recv_exact(HEADER.size))
        assert (magic, version) == (MAGIC, VERSION)
        return op, status, count, self.recv_exact(n)

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def handshake(self, secret: bytes, *, expect: int = AUTH_OK) -> bytes:
        """Proves the secret; returns the body of the server's last frame (`expect`)."""
        nonce = os.urandom(32)
        self.send(frame(HELLO, nonce))
        op, _, _, body = self.recv_frame()
        assert op == CHALLENGE
        server_nonce = body[:32]
        proof = hmac.new(secret, b"tpusync/1 client" + server_nonce + nonce, hashlib.sha256).digest()
        self.send(frame(AUTH, proof))
        op, _, _, body = self.recv_frame()
        assert op == expect, (op, body)
        return body
