"""The connector's configuration and its `kv_transfer_params` contract (pure: no vLLM, no torch).

`kv_connector_extra_config` keys (all optional):

    control_socket   the pod's sidecar control socket (default: $TPUSYNC_CONTROL_SOCKET)
    store            "sidecar" (the default when a control socket is known) or "local": an
                     in-process store shared by the scheduler and the worker, with no sidecar;
                     needs them in one process (distributed_executor_backend="uni")
    pool_path        "local" only: the shared-memory pool file (survives an engine restart)
    dram_bytes       "local" only: the pool's size (default 1 GiB)
    layerwise        load layer by layer, overlapping the model's forward (default true)
    hash_seed        the block-key seed (docs/block-keys.md; default "tpusync"); engines that
                     share a store must agree on it, and engines of different models must not
    data_address     host:port of this pod's sidecar data port, advertised to decode engines
                     (default: $TPUSYNC_DATA_ADDRESS, else $POD_IP:$TPUSYNC_DATA_PORT)
    peers            sidecar data addresses to look for prefixes in (list or comma-separated)
    timeout_s        control-socket and peer call timeout (default 30)
    retry_s          after a store failure, how long to run without it before reconnecting (default 5)
    kv_events_audit_s  with vLLM's KV events enabled (--kv-events-config), how often to ask the
                     store where the announced blocks are, a backstop to its change feed
                     (docs/vllm.md; default 2; 0: never)
    kv_events_endpoint  where the router subscribes to this engine's KV events, when the connector
                     publishes its own as they happen instead of at vLLM's next step (e.g.
                     "tcp://*:5557"; vLLM's --kv-events-config endpoint then binds where the
                     connector relays it from, e.g. "inproc://vllm-kv-events"; tpusync.connector.relay)

`kv_transfer_params` follow vLLM's NixlConnector conventions. The router (or a proxy) sends the
prefill engine `{"do_remote_decode": true}`; the prefill engine's `request_finished` answers
(see `producer_params`):

    do_remote_prefill: true, do_remote_decode: false
    remote_host, remote_port   the prefill pod's sidecar data port (omitted if unknown)
    remote_engine_id, remote_request_id
    remote_block_ids: []       tpusync blocks are content-addressed: vLLM's block ids never travel
    remote_num_tokens          prompt tokens whose KV is in the prefill pod's sidecar
    tpusync_block_size, tpusync_last_key   the block size and the hex key of the last block, so
                               the decode engine can tell a hash-seed or block-size mismatch
    tpusync_kv_layout          what the blocks' bytes depend on (`kv_layout`); on a multi-host
                               slice also `hosts`: the shard numbers each host holds
    remote_addresses           a multi-host slice's hosts' sidecar data ports, in process order:
                               each decode host pulls the parts it needs from the hosts holding them

and the decode engine, given those params with the same prompt, pulls the blocks it lacks from
`remote_host:remote_port` into its own sidecar and loads them (see `remote_peer`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tpusync import errors
from tpusync.hashing import DEFAULT_SEED
from tpusync.slice_pulls import host_shards_of, pull_plan, slice_hosts

STORES = ("sidecar", "local")


ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class ConnectorConfig:
    control_socket: str | None = None
    store: str = "sidecar"
    pool_path: str | None = None
    dram_bytes: int = 1 << 30
    layerwise: bool = True
    hash_seed: str = DEFAULT_SEED
    data_address: str | None = None
    peers: tuple[str, ...] = field(default_factory=tuple)
    timeout_s: float = 30.0
    retry_s: float = 5.0
    kv_events_audit_s: float = 2.0
    kv_events_endpoint: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
        """Reads `kv_connector_extra_config`, with environment defaults. InvalidArgumentError on bad values."""
        extra = dict(extra or {})
        env = os.environ if env is None else env
        unknown = set(extra) - set(cls.__dataclass_fields__)
        if unknown:
            raise errors.InvalidArgumentError(f"unknown kv_connector_extra_config keys: {sorted(unknown)}")
        control_socket = extra.get("control_socket") or env.get("TPUSYNC_CONTROL_SOCKET") or None
        store = extra.get("store") or ("sidecar" if control_socket else "local")
        if store not in STORES:
            raise errors.InvalidArgumentError(f"store must be one of {STORES}, not {store!r}")
        if store == "sidecar" and not control_socket:
            raise errors.InvalidArgumentError('store "sidecar" needs control_socket (or $TPUSYNC_CONTROL_SOCKET)')
        peers = extra.get("peers") or ()
        if isinstance(peers, str):
            peers = [p.strip() for p in peers.split(",")]
        data_address = extra.get("data_address") or env.get("TPUSYNC_DATA_ADDRESS") or None
        if data_address is None and env.get("POD_IP") and env.get("TPUSYNC_DATA_PORT"):
            data_address = f"{env['POD_IP']}:{env['TPUSYNC_DATA_PORT']}"
        cfg = cls(
            control_socket=control_socket,
            store=store,
            pool_path=extra.get("pool_path"),
            dram_bytes=int(extra.get("dram_bytes", cls.dram_bytes)),
            layerwise=flag(extra.get("layerwise", True)),
            hash_seed=str(extra.get("hash_seed", DEFAULT_SEED)),
            data_address=data_address,
            peers=tuple(p for p in peers if p),
            timeout_s=float(extra.get("timeout_s", cls.timeout_s)),
            retry_s=float(extra.get("retry_s", cls.retry_s)),
            kv_events_audit_s=float(extra.get("kv_events_audit_s", cls.kv_events_audit_s)),
            kv_events_endpoint=extra.get("kv_events_endpoint") or None,
        )
        if cfg.timeout_s <= 0 or cfg.retry_s < 0 or cfg.dram_bytes <= 0 or cfg.kv_events_audit_s < 0:
            raise errors.InvalidArgumentError("timeout_s and dram_bytes must be positive, retry_s and "
                                              "kv_events_audit_s not negative")
        endpoint = cfg.kv_events_endpoint
        if endpoint is not None and not (isinstance(endpoint, str) and endpoint.startswith(ZMQ_SCHEMES)):
            raise errors.InvalidArgumentError(f"kv_events_endpoint must be a ZMQ endpoint ({', '.join(ZMQ_SCHEMES)}…), "
                                              f"not {endpoint!r}")
        return cfg


def flag(value: Any) -> bool:
    """A boolean option: true, false, or a string such as "0", "off", "yes"."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, sep, port = address.removeprefix("tpusync://").rpartition(":")
    if not sep or not port.isdigit():
        raise errors.InvalidArgumentError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def kv_layout(*, model: str, layers: int, kv_heads: int, head_size: int, dtype: str, shards: int) -> dict[str, Any]:
    """What a block's bytes depend on besides its tokens, as a prefill engine tells its decode
    engines: they load its blocks only where all but `shards` (the parts a block is stored in,
    one per tensor-parallel shard) equal their own."""
    return {"model": model, "layers": layers, "kv_heads": kv_heads, "head_size": head_size, "dtype": dtype,
            "shards": shards}


def producer_params(*, data_address: str | None, engine_id: str, request_id: str, num_tokens: int,
                    block_size: int, last_key: int | None, layout: dict[str, Any] | None = None,
                    hosts: list[tuple[str | None, list[int]]] | None = None) -> dict[str, Any]:
    """The kv_transfer_params a prefill engine returns for a request it computed for a decode
    engine. `hosts`: a multi-host slice's hosts in process order (data port, shard numbers
    held there), as `remote_addresses` and the layout's `hosts`."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [],
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


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode engine reads from kv_transfer_params: where to pull and how much."""

    peer: str | None          # "host:port" of the prefill pod's sidecar, None: look locally only
    num_tokens: int | None    # prompt tokens the prefill engine stored (None: unknown, try all)
    block_size: int | None
    last_key: int | None
    layout: dict[str, Any] | None = None  # kv_layout() of the prefill engine, if it said
    addresses: list[str | None] | None = None  # a multi-host prefill's hosts' data ports (None where malformed)
    hosts: list[list[int]] | None = None       # the shard numbers each of those hosts holds

    def pulls(self, needed: list[int], host: int) -> list[tuple[str, list[int]]]:
        """Where host `host` of this engine pulls the prefill's shards `needed` from
        (tpusync.slice_pulls.pull_plan): a multi-host prefill's hosts, else its one peer."""
        addresses = self.addresses if self.addresses is not None else [self.peer]
        return pull_plan(addresses, self.hosts, needed, host)


def remote_peer(params: Mapping[str, Any] | None) -> RemotePrefill | None:
    """The remote prefill named by kv_transfer_params, or None if the request has none."""
    if not params or not params.get("do_remote_prefill"):
        return None
    host, port = params.get("remote_host"), params.get("remote_port")
    peer = join_address(str(host), int(port)) if host and port else None
    last = params.get("tpusync_last_key")
    layout = params.get("tpusync_kv_layout")
    layout = layout if isinstance(layout, dict) else None
    shards = layout.get("shards") if layout is not None else None
    return RemotePrefill(
        peer=peer,
        num_tokens=_opt_int(params.get("remote_num_tokens")),
        block_size=_opt_int(params.get("tpusync_block_size")),
        last_key=int(last, 16) if isinstance(last, str) and last else None,
        layout=layout,
        addresses=slice_hosts(params.get("remote_addresses")),
        hosts=host_shards_of(layout.get("hosts"), shards) if layout is not None and isinstance(shards, int) else None,
    )


def _opt_int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
