"""The SGLang backend's options: its extra config (`--hicache-storage-backend-extra-config`), parsed
once, when SGLang's factory builds the backend. Pure: imports neither SGLang nor torch.

Who can set it: the operator, on SGLang's command line, or an admin through SGLang's
`PUT /hicache/storage-backend` (sglang/srt/entrypoints/http_server.py, refused unless SGLang runs
with an admin API key; the scheduler answers a backend that fails to build with a failure and
keeps serving, scheduler.py `attach_hicache_storage_wrapped`). No client request reaches it: a
request reaches the backend only as the page hashes SGLang computes from its tokens. So a
malformed value fails the build with InvalidArgumentError naming the field (SGLang's start
fails, or the attach is answered with the message) rather than making a backend that misses on
every call or reads `"peers": "10.0.0.2:7600"` as peers "1", "0", ".", ...

Keys neither tpusync nor SGLang's factory reads are logged by the backend (`ignored`) and
otherwise ignored: SGLang takes its own from the same object (`prefetch_threshold`, ...).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tpusync import errors

FACTORY_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})  # SGLang's dynamic factory
_LOCAL_KEYS = frozenset({"dram_bytes", "block_bytes", "pool_path", "disk_dir", "disk_bytes"})
_MAX_PEERS = 1024
# A peer's data port: host:port (tpusync:// optional), the host a DNS name, an IPv4 address or an
# IPv6 one in brackets. Names are allowed here: the operator chose them, not a client.
_PEER = re.compile(r"(?:tpusync://)?(?:[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})")


@dataclass(frozen=True)
class LocalStore:
    """`local`: an in-process store, no sidecar."""

    dram_bytes: int
    block_bytes: int
    pool_path: str | None = None
    disk_dir: str | None = None
    disk_bytes: int = 0


@dataclass(frozen=True)
class StorageOptions:
    """The extra config's options (docs/sglang.md)."""

    control_socket: str | None = None   # the pod's sidecar (default $TPUSYNC_CONTROL_SOCKET)
    store_url: str | None = None        # a sidecar's data port instead, with secret_file
    secret_file: str | None = None
    timeout_s: float = 30.0
    local: LocalStore | None = None
    peers: tuple[str, ...] = ()
    model: str | None = None
    reconnect_interval_s: float = 1.0
    kv_events: Any = None               # checked by tpusync.engines.sglang.events.EventsConfig.parse (needs SGLang)
    ignored: tuple[str, ...] = field(default=())  # keys no one here reads

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> StorageOptions:
        """The options of `extra`; InvalidArgumentError naming the first malformed field."""
        local = _local(extra.get("local"))
        store_url = _text(extra, "store_url")
        if local is not None and store_url is not None:
            raise errors.InvalidArgumentError("local and store_url name two stores: set one")
        known = set(cls.__dataclass_fields__) - {"ignored"}
        return cls(
            control_socket=_text(extra, "control_socket"), store_url=store_url,
            secret_file=_text(extra, "secret_file"),
            timeout_s=_seconds(extra, "timeout_s", cls.timeout_s, positive=True), local=local,
            peers=_peers(extra.get("peers")), model=_text(extra, "model"),
            reconnect_interval_s=_seconds(extra, "reconnect_interval_s", cls.reconnect_interval_s, positive=False),
            kv_events=extra.get("kv_events"),
            ignored=tuple(sorted(str(k) for k in extra if k not in known and k not in FACTORY_KEYS)))


def _refused(name: str, value: object, expected: str) -> errors.InvalidArgumentError:
    return errors.InvalidArgumentError(f"extra config {name} is {value!r:.80}, not {expected}")


def _text(extra: Mapping[str, Any], name: str) -> str | None:
    value = extra.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise _refused(name, value, "a non-empty string")
    return value


def _seconds(extra: Mapping[str, Any], name: str, default: float, *, positive: bool) -> float:
    value = extra.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1e9 \
            or (positive and value == 0):
        raise _refused(name, value, "a positive number of seconds" if positive else "a number of seconds, 0 or more")
    return float(value)


def _peers(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > _MAX_PEERS:
        raise _refused("peers", value, f'a list of at most {_MAX_PEERS} "host:port" strings')
    for i, peer in enumerate(value):
        match = _PEER.fullmatch(peer) if isinstance(peer, str) else None
        if match is None or not 0 < int(match.group(1)) < 65536:
            raise _refused(f"peers[{i}]", peer, '"host:port"')
    return tuple(value)


def _local(value: object) -> LocalStore | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _refused("local", value, f"an object with {sorted(_LOCAL_KEYS)}")
    if unknown := set(value) - _LOCAL_KEYS:
        raise errors.InvalidArgumentError(f"extra config local: unknown fields {sorted(unknown)}; it takes "
                                          f"{sorted(_LOCAL_KEYS)}")
    sizes = {}
    for name in ("dram_bytes", "block_bytes", "disk_bytes"):
        n = value.get(name, 0 if name == "disk_bytes" else None)
        least = 0 if name == "disk_bytes" else 1
        if not isinstance(n, int) or isinstance(n, bool) or not least <= n < 1 << 48:
            raise _refused(f"local.{name}", n, "a number of bytes")
        sizes[name] = n
    paths = {}
    for name in ("pool_path", "disk_dir"):
        path = value.get(name)
        if path is not None and (not isinstance(path, str) or not path):
            raise _refused(f"local.{name}", path, "a path")
        paths[name] = path
    return LocalStore(sizes["dram_bytes"], sizes["block_bytes"], paths["pool_path"], paths["disk_dir"],
                      sizes["disk_bytes"])
