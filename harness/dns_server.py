"""A DNS server for tests: answers A queries from a fixed table over UDP, NXDOMAIN for any other
name (NOERROR with no answer for another type of a known name), and appends every question's
name to a log file, so a test can tell which names a process looked up.

Run inside a simulated host (harness/fabric.py) whose /etc/netns/<ns>/resolv.conf names
it: python -m harness.dns_server LOG ADDRESS NAME=IP [NAME=IP ...]. It prints "ready"
once bound. The wire format is RFC 1035's (section 4): a 12-byte header, the question, and for
an answer one A record pointing back at the question's name.
"""

from __future__ import annotations

import socket
import struct
import sys

QTYPE_A = 1
NXDOMAIN, NOERROR = 3, 0


def question(packet: bytes) -> tuple[str, int, int]:
    """The first question's name, type, and the offset just past it."""
    labels, i = [], 12
    while packet[i]:
        n = packet[i]
        labels.append(packet[i + 1:i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    qtype = struct.unpack_from("!H", packet, i + 1)[0]
    return ".".join(labels).lower(), qtype, i + 5


def answer(packet: bytes, table: dict[str, str]) -> tuple[str, bytes]:
    name, qtype, end = question(packet)
    ident = packet[:2]
    known = name in table
    rcode = NOERROR if known else NXDOMAIN
    answers = b""
    if known and qtype == QTYPE_A:
        # A pointer to the question's name (offset 12), type A, class IN, TTL 0, 4 bytes.
        answers = struct.pack("!HHHIH", 0xC00C, QTYPE_A, 1, 0, 4) + socket.inet_aton(table[name])
    flags = 0x8400 | rcode  # a response, authoritative
    header = ident + struct.pack("!HHHHH", flags, 1, 1 if answers else 0, 0, 0)
    return name, header + packet[12:end] + answers


def main(argv: list[str]) -> int:
    log, address, *entries = argv
    table = dict(e.split("=", 1) for e in entries)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, 53))
    print("ready", flush=True)
    with open(log, "a", buffering=1) as out:
        while True:
            packet, peer = sock.recvfrom(4096)
            try:
                name, reply = answer(packet, table)
            except (IndexError, struct.error):
                continue  # not a query this server understands
            out.write(name + "\n")
            sock.sendto(reply, peer)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
