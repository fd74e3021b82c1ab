"""Where a decode host pulls a prefill's parts from, when the prefill is a multi-host slice: the
prefill names every host's sidecar data port (in process order) and which shards of each block
each host holds; a decode host pulls the parts its own shards need from the hosts that hold them.
Shared by the reference engine (`tpusync.serving.engine`) and the tpu-inference connector
(`tpusync.tpu_inference.worker`). Pure: addresses come from clients and are checked here."""

from __future__ import annotations

import logging
import re

log = logging.getLogger("tpusync")

# A sidecar's data port, as kv_transfer_params name it: host:port (tpusync:// optional), the host
# a DNS name or an IPv4 address, or an IPv6 one in brackets or bare ($(POD_IP):port on IPv6 pods).
_PEER_ADDRESS = re.compile(r"(?:tpusync://)?(?:[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]"
                           r"|[0-9A-Fa-f.]{0,45}:[0-9A-Fa-f:.]{0,45}):([0-9]{1,5})")

MAX_HOSTS = 1024


def peer_address(address: object, field: str) -> str | None:
    """`address` if it is a host:port a sidecar may be asked to pull from, else None (logged:
    anything else is never passed on)."""
    if address is None or address == "":
        return None
    match = _PEER_ADDRESS.fullmatch(address) if isinstance(address, str) and len(address) <= 300 else None
    if match is None or not 0 < int(match.group(1)) < 65536:
        log.warning("ignoring a malformed kv_transfer_params %s: %.80r", field, address)
        return None
    return match.string


def slice_hosts(listed: object, field: str = "remote_addresses") -> list[str | None] | None:
    """A slice's host addresses as a client sent them, each checked (None where malformed), or
    None when `listed` is not a list of at most MAX_HOSTS."""
    if not isinstance(listed, list) or not 0 < len(listed) <= MAX_HOSTS:
        return None
    return [peer_address(a, field) for a in listed]


def host_shards_of(hosts: object, shards: int) -> list[list[int]] | None:
    """The prefill's shard numbers per host (a list per host of numbers below `shards`), or None
    when `hosts` is not that."""
    valid = isinstance(hosts, list) and len(hosts) <= MAX_HOSTS and all(
        isinstance(h, list) and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < shards for n in h)
        for h in hosts)
    return hosts if valid else None  # type: ignore[return-value]


def pull_plan(addresses: list[str | None], hosts: list[list[int]] | None, needed: list[int],
              host: int) -> list[tuple[str, list[int]]]:
    """Where to pull which of the prefill's shards: from each prefill host the needed shards it
    holds, when `hosts` names them for every address; else every needed shard from each prefill
    host in turn, this host's counterpart (the same process index) first."""
    if hosts is not None and len(addresses) == len(hosts):
        return [(peer, mine) for peer, held in zip(addresses, hosts)
                if peer is not None and (mine := [m for m in needed if m in held])]
    valid = [a for a in addresses if a is not None]
    first = host % len(valid) if valid else 0
    return [(peer, needed) for peer in valid[first:] + valid[:first]]
