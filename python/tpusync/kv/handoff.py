"""The prefill-to-decode contract: the `kv_transfer_params` a prefill engine answers with, the one
typed parser of what a decode engine is sent back, and where a decode host pulls the blocks from.

`kv_transfer_params` is a field of the completion request, so any client may set it, and a vLLM
decode engine reads it on its scheduler's thread, which vLLM runs unguarded: an exception there
stops the engine. Every field tpusync reads is therefore parsed here, by type and range, before
anything uses it. A malformed one refuses the whole hand-off (`MalformedParams` names the field);
the engine logs that once for the request (`log_refusal`) and computes the prompt itself, as it
would without a prefill engine. Keys tpusync does not read are ignored without a word: vLLM,
P/D proxies and other connectors share the object (vLLM adds `remote_prefill_cached_tokens` to
every prefill's answer; NIXL's dialect brings `remote_engine_id`, `remote_block_ids`, ...).

Addresses a request names are literal IP addresses with a port. A sidecar is asked to pull from
them; a name would have it resolve a host of the client's choosing before it checks that the
host is a pool member (the operator always advertises `$(POD_IP):port`).

vLLM's dialect (the vLLM and tpu-inference connectors; NixlConnector's conventions). A proxy
sends the prefill engine `{"do_remote_decode": true}`; `producer_params` is its answer, which the
proxy hands to the decode engine. What the decode engine reads, with `do_remote_prefill: true`:

    remote_host, remote_port   a literal IP address and a port in [1, 65535], both or neither
    remote_num_tokens          prompt tokens the prefill stored, in [0, 2^32]
    tpusync_block_size         its tokens per block, in [1, 65536]
    tpusync_last_key           its last block's key: 32 hex digits
    tpusync_kv_layout          an object (`kv_layout`): model, dtype and format strings, layers,
                               kv_heads, head_size whole numbers, shards in [1, 4096] (required),
                               and on a multi-host slice hosts: per host the shard numbers it holds
    remote_addresses           a multi-host slice's hosts' data ports in process order (at most
                               1024; null or "" for a host without one)

Every engine speaks this one dialect: the vLLM and tpu-inference connectors and the reference
engine (`tpusync.serving`) alike, so a prefill of one may hand off to a decode of another. What a
decode engine does with a parsed hand-off is here too: whether it can load the prefill's blocks
(`layout_refusal`, the one layout check), which blocks the prefill stored (`stored_blocks`), where
each host pulls which parts from (`pull_plan`), and the pull itself (`pull`).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpusync import errors

MAX_HOSTS = 1024            # hosts of a multi-host prefill
MAX_SHARDS = 4096           # parts a block is stored in
MAX_TOKENS = 1 << 32        # tokens of a prompt
MAX_BLOCK_TOKENS = 1 << 16  # tokens of a block
MAX_LAYOUT_NUMBER = 1 << 20  # layers, heads, head size
MAX_TEXT = 1024             # a layout's model or dtype
_MAX_ADDRESS = 80           # "tpusync://[v6%scope]:port" fits
_KEY = re.compile(r"[0-9a-fA-F]{32}")
_PORT = re.compile(r"[0-9]{1,5}")
_LAYOUT_NUMBERS = ("layers", "kv_heads", "head_size")
_LAYOUT_TEXTS = ("model", "dtype", "format")
_SHOWN = reprlib.Repr()  # a value in a log line: short, quoted, one line
_SHOWN.maxstring = _SHOWN.maxother = 60


class MalformedParams(errors.InvalidArgumentError):
    """A field of kv_transfer_params that is not what the contract says: the hand-off is refused."""

    def __init__(self, field: str, value: object, expected: str) -> None:
        where = f"kv_transfer_params.{field}" if field else "kv_transfer_params"
        super().__init__(f"{where} is {_SHOWN.repr(value)}, not {expected}")
        self.field = field


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode engine may use of a hand-off: where to pull the prefill's blocks and what
    they are. Every field parsed (`vllm_prefill`)."""

    peer: str | None                       # "ip:port" of the prefill's sidecar; None: look locally only
    num_tokens: int | None = None          # prompt tokens the prefill stored (None: unknown, try all)
    block_size: int | None = None          # its tokens per block
    last_key: int | None = None            # its last block's key
    layout: dict[str, int | str] | None = None  # what its blocks' bytes depend on (`kv_layout`), if it said
    addresses: list[str | None] | None = None   # a multi-host prefill's hosts' data ports (None: none known)
    hosts: list[list[int]] | None = None        # the shard numbers each of those hosts holds

    @property
    def shards(self) -> int | None:
        """The parts the prefill stored each block in, if it said."""
        return None if self.layout is None else int(self.layout["shards"])

    @property
    def hosts_addresses(self) -> list[str | None]:
        """The prefill's data ports: a multi-host prefill's hosts, else its one peer."""
        return self.addresses if self.addresses is not None else [self.peer]

    def pulls(self, needed: list[int], host: int, peers: Sequence[str] = ()) -> list[tuple[str, list[int]]]:
        """Where host `host` of the decode engine pulls the prefill's shards `needed` from
        (`pull_plan`): a multi-host prefill's hosts, else its one peer; then `peers`."""
        return pull_plan(self.hosts_addresses, self.hosts, needed, host, peers)


# -- the producer ------------------------------------------------------------------------

# How each engine arranges a block's bytes (`format` in kv_layout): engines of one format load each
# other's blocks; two engines of one model and geometry but another format never do.
FORMAT_VLLM = "vllm-torch"            # layer after layer, each as vLLM's attention backend pages it
FORMAT_TPU_INFERENCE = "tpu-inference"  # layer after layer, each as tpu-inference's kernel packs K and V
FORMAT_REFERENCE = "k-v"              # K then V, each [layers, page_size, kv_heads, head_dim] (tpusync.kv.pages)


def kv_layout(*, model: str, layers: int, kv_heads: int, head_size: int, dtype: str, shards: int,
              format: str) -> dict[str, Any]:
    """What a block's bytes depend on besides its tokens, as a prefill engine tells its decode
    engines: they load its blocks only where all but `shards` (the parts a block is stored in,
    one per tensor-parallel shard) equal their own, `format` (how the engine arranges a
    block's bytes, FORMAT_*) included."""
    return {"model": model, "layers": layers, "kv_heads": kv_heads, "head_size": head_size, "dtype": dtype,
            "format": format, "shards": shards}


def producer_params(*, data_address: str | None, engine_id: str, request_id: str, num_tokens: int,
                    block_size: int, last_key: int | None, layout: dict[str, Any] | None = None,
                    hosts: list[tuple[str | None, list[int]]] | None = None) -> dict[str, Any]:
    """The kv_transfer_params a prefill engine returns for a request it computed for a decode
    engine (vLLM's dialect). `hosts`: a multi-host slice's hosts in process order (data port,
    shard numbers held there), as `remote_addresses` and the layout's `hosts`."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [],  # tpusync blocks are content-addressed: vLLM's block ids never travel
        "remote_num_tokens": num_tokens,
        "tpusync_block_size": block_size,
    }
    if last_key is not None:
        params["tpusync_last_key"] = f"{last_key:032x}"
    if layout is not None:
        params["tpusync_kv_layout"] = layout if not hosts else {**layout, "hosts": [h for _, h in hosts]}
    if hosts:
        params["remote_addresses"] = [a for a, _ in hosts]
    if data_address:
        params["remote_host"], params["remote_port"] = split_address(data_address)
    return params


# -- the parser --------------------------------------------------------------------------

def vllm_prefill(params: object) -> RemotePrefill | None:
    """The remote prefill a decode engine's request names in vLLM's dialect, or None when it
    names none (no `do_remote_prefill: true`). MalformedParams when a field is malformed."""
    if params is None:
        return None
    p = _object(params)
    if not _flag(p, "do_remote_prefill"):
        return None
    host, port = _literal_host(p, "remote_host"), _number(p, "remote_port", 1, 65535)
    if (host is None) != (port is None):
        field = "remote_port" if port is None else "remote_host"
        raise MalformedParams(field, p.get(field), "given: remote_host and remote_port come together")
    layout, hosts = _layout(p, "tpusync_kv_layout")
    addresses = _addresses(p, "remote_addresses", hosts)
    last = p.get("tpusync_last_key")
    return RemotePrefill(
        peer=None if host is None or port is None else join_address(host, port),
        num_tokens=_number(p, "remote_num_tokens", 0, MAX_TOKENS),
        block_size=_number(p, "tpusync_block_size", 1, MAX_BLOCK_TOKENS),
        last_key=None if last is None else _key(last, "tpusync_last_key"),
        layout=layout, addresses=addresses, hosts=hosts)


def wants_decode(params: object) -> bool:
    """Whether a prefill engine's request asks for a hand-off (`do_remote_decode: true`).
    MalformedParams when that field is not a boolean."""
    return params is not None and _flag(_object(params), "do_remote_decode")


def log_refusal(log: logging.Logger, request_id: str, refused: MalformedParams) -> None:
    """The one line a refused hand-off gets: which request, which field, what was there."""
    log.warning("request %s: %s; its prefill-to-decode hand-off is refused (this engine computes the prompt)",
                request_id, refused)


def _object(params: object) -> Mapping[str, Any]:
    if not isinstance(params, Mapping):
        raise MalformedParams("", params, "an object")
    return params


def _flag(p: Mapping[str, Any], field: str) -> bool:
    value = p.get(field)
    if value is not None and not isinstance(value, bool):
        raise MalformedParams(field, value, "true or false")
    return bool(value)


def _number(p: Mapping[str, Any], field: str, low: int, high: int) -> int | None:
    return _whole(p.get(field), field, low, high)


def _whole(value: object, field: str, low: int, high: int) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MalformedParams(field, value, f"a whole number in [{low}, {high}]")
    return value


def _key(value: object, field: str) -> int:
    if not isinstance(value, str) or not _KEY.fullmatch(value):
        raise MalformedParams(field, value, "a block key (32 hex digits)")
    return int(value, 16)


def _literal_host(p: Mapping[str, Any], field: str) -> str | None:
    value = p.get(field)
    if value is None:
        return None
    host = _literal(value.removeprefix("[").removesuffix("]")) if isinstance(value, str) and \
        len(value) <= _MAX_ADDRESS else None
    if host is None:
        raise MalformedParams(field, value, "a literal IP address")
    return host


def _address(value: object, field: str) -> str | None:
    """A literal "ip:port" (normalised: "[v6]:port"), None for null or ""."""
    if value is None or value == "":
        return None
    split = split_literal(value) if isinstance(value, str) else None
    if split is None:
        raise MalformedParams(field, value, "a literal IP address and port (ip:port, [ip]:port)")
    return join_address(*split)


def _addresses(p: Mapping[str, Any], field: str, hosts: list[list[int]] | None) -> list[str | None] | None:
    listed = p.get(field)
    if listed is None:
        return None
    if not isinstance(listed, list) or not 0 < len(listed) <= MAX_HOSTS:
        raise MalformedParams(field, listed, f"a list of 1 to {MAX_HOSTS} addresses")
    if hosts is not None and len(hosts) != len(listed):
        raise MalformedParams(field, listed, f"one address per host of the layout's hosts ({len(hosts)})")
    return [_address(a, f"{field}[{i}]") for i, a in enumerate(listed)]


def _layout(p: Mapping[str, Any], field: str) -> tuple[dict[str, int | str] | None, list[list[int]] | None]:
    """A layout object's known fields, checked (the others ignored), and its hosts' shards."""
    value = p.get(field)
    if value is None:
        return None, None
    if not isinstance(value, Mapping):
        raise MalformedParams(field, value, "an object")
    layout: dict[str, int | str] = {}
    for name in _LAYOUT_NUMBERS:
        n = _whole(value.get(name), f"{field}.{name}", 1, MAX_LAYOUT_NUMBER)
        if n is not None:
            layout[name] = n
    for name in _LAYOUT_TEXTS:
        text = value.get(name)
        if text is not None and (not isinstance(text, str) or len(text) > MAX_TEXT):
            raise MalformedParams(f"{field}.{name}", text, f"a string of at most {MAX_TEXT} characters")
        if text is not None:
            layout[name] = text
    shards = _whole(value.get("shards"), f"{field}.shards", 1, MAX_SHARDS)
    if shards is None:
        raise MalformedParams(f"{field}.shards", None, f"given: a whole number in [1, {MAX_SHARDS}]")
    layout["shards"] = shards
    return layout, _host_shards(value.get("hosts"), f"{field}.hosts", shards)


def _host_shards(hosts: object, field: str, shards: int) -> list[list[int]] | None:
    """Per host, the shard numbers (below `shards`) it holds."""
    if hosts is None:
        return None
    if not isinstance(hosts, list) or not 0 < len(hosts) <= MAX_HOSTS:
        raise MalformedParams(field, hosts, f"a list of 1 to {MAX_HOSTS} hosts' shard lists")
    for i, held in enumerate(hosts):
        if not isinstance(held, list) or len(held) > shards or not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n < shards for n in held):
            raise MalformedParams(f"{field}[{i}]", held, f"a list of shard numbers below {shards}")
    return hosts


# -- addresses -----------------------------------------------------------------------------

def _literal(host: str) -> str | None:
    """`host` as a literal IP address (normalised), or None: a name, a scoped or a malformed one."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return None if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id else str(ip)


def split_literal(address: str) -> tuple[str, int] | None:
    """(ip, port) of "ip:port", "[ip]:port" or a bare IPv6 address and port ($(POD_IP):port on
    an IPv6 pod), tpusync:// optional; None for anything else (a name included)."""
    if len(address) > _MAX_ADDRESS:
        return None
    host, sep, port = address.removeprefix("tpusync://").rpartition(":")
    if not sep or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        return None
    if host.startswith("["):
        if not host.endswith("]"):
            return None
        host = host[1:-1]
    ip = _literal(host)
    return None if ip is None else (ip, int(port))


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of a literal address (`split_literal`); InvalidArgumentError otherwise."""
    split = split_literal(address)
    if split is None:
        raise errors.InvalidArgumentError(f"expected a literal ip:port, got {_SHOWN.repr(address)}")
    return split


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- where to pull from --------------------------------------------------------------------

def pull_plan(addresses: list[str | None], hosts: list[list[int]] | None, needed: list[int],
              host: int, peers: Sequence[str] = ()) -> list[tuple[str, list[int]]]:
    """Where to pull which of a multi-host prefill's shards: from each prefill host the needed
    shards it holds, when `hosts` names them for every address; else every needed shard from
    each prefill host in turn, this host's counterpart (the same process index) first. Then
    every needed shard from each of `peers` not already named (prefixes other engines stored)."""
    if hosts is not None and len(addresses) == len(hosts):
        plan = [(peer, mine) for peer, held in zip(addresses, hosts)
                if peer is not None and (mine := [m for m in needed if m in held])]
    else:
        valid = [a for a in addresses if a is not None]
        first = host % len(valid) if valid else 0
        plan = [(peer, needed) for peer in valid[first:] + valid[:first]]
    named = {peer for peer, _ in plan}
    return plan + [(peer, needed) for peer in dict.fromkeys(peers) if peer not in named]


@dataclass(frozen=True)
class Pulled:
    """What one peer of a pull brought: `blocks` more leading blocks local, of parts `parts`."""

    peer: str
    parts: list[int]
    blocks: int


@dataclass(frozen=True)
class Pull:
    """A pull's outcome: the leading blocks local at its end, and what each peer brought."""

    local: int
    pulled: list[Pulled]

    @property
    def blocks(self) -> int:
        return sum(p.blocks for p in self.pulled)


def pull(plan: Sequence[tuple[str, list[int]]], blocks: int, held: Callable[[], int],
         fetch: Callable[[str, int, list[int]], object],
         failed: Callable[[str, int, errors.TpuSyncError], None]) -> Pull:
    """The pull loop every decode engine runs: asks each peer of `plan` in turn, until the first
    `blocks` blocks are local, for the parts it holds of the blocks still missing. `held()`: the
    leading blocks local now (every needed part of each); `fetch(peer, first, parts)` has the
    sidecar pull parts `parts` of blocks [first, blocks) from `peer`; a TpuSyncError of a peer
    goes to `failed(peer, missing, error)` and the next peer is asked (what came stays). A
    TpuSyncError of `held` (this host's sidecar) is raised."""
    local = held()
    out: list[Pulled] = []
    for peer, parts in plan:
        if local >= blocks:
            break
        try:
            fetch(peer, local, parts)
        except errors.TpuSyncError as e:  # a dead or unreachable peer: the next one, keep what came
            failed(peer, blocks - local, e)
            continue
        now = held()
        out.append(Pulled(peer, parts, max(0, now - local)))
        local = max(local, now)
    return Pull(local, out)


# -- whether and what to load --------------------------------------------------------------

def _dtype(name: object) -> object:
    """A dtype's name as engines of either framework write it ("torch.bfloat16", "bfloat16")."""
    return name.removeprefix("torch.") if isinstance(name, str) else name


def layout_refusal(theirs: Mapping[str, int | str] | None, ours: Mapping[str, Any] | None, *,
                   reshards: bool) -> str | None:
    """The one layout check: why blocks of a prefill with KV layout `theirs` (parsed) cannot be
    loaded by an engine of layout `ours` (`kv_layout`), or None. Every field but the split must
    be equal; another split (`shards`) only where the engine `reshards` and it splits the kv
    heads. Without a layout on either side, keys and block sizes decide, as they always did."""
    if theirs is None or ours is None:
        return None
    other = [f"{k} {theirs.get(k)!r}, here {v!r}" for k, v in ours.items()
             if k not in ("shards", "hosts") and _dtype(theirs.get(k)) != _dtype(v)]
    if other:
        return "; ".join(other)
    shards, heads = int(theirs["shards"]), int(ours["kv_heads"])
    if shards == ours["shards"]:
        return None
    if not reshards:
        return f"blocks in {shards} parts, this engine loads only its own {ours['shards']}"
    if shards > heads or heads % shards:
        return f"blocks in {shards} parts do not split {heads} kv heads"
    return None


def stored_blocks(remote: RemotePrefill, keys: Sequence[int], block_tokens: int) -> int | None:
    """How many of `keys` (the prompt keyed at the prefill's block size, `block_tokens`) the
    prefill stored: all when it did not say, None when its last key is not ours (another
    hash_seed, another prompt: nothing to pull)."""
    stored = len(keys) if remote.num_tokens is None else remote.num_tokens // block_tokens
    if remote.last_key is not None and stored and (stored > len(keys) or keys[stored - 1] != remote.last_key):
        return None
    return min(stored, len(keys))
