"""The connector's configuration, `kv_connector_extra_config` (pure: no vLLM, no torch).

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
    data_address     ip:port of this pod's sidecar data port, advertised to decode engines: a
                     literal IP address, as decode engines accept no other (default:
                     $TPUSYNC_DATA_ADDRESS, else $POD_IP:$TPUSYNC_DATA_PORT)
    peers            sidecar data addresses to look for prefixes in (list or comma-separated)
    timeout_s        control-socket and peer call timeout (default 30)
    retry_s          after a store failure, how long to run without it before reconnecting (default 5)
    kv_events_audit_s  with vLLM's KV events enabled (--kv-events-config), how often to ask the
                     store where the announced blocks are, a backstop to its change feed
                     (docs/vllm.md; default 2; 0: never)
    kv_events_endpoint  where the router subscribes to this engine's KV events, when the connector
                     publishes its own as they happen instead of at vLLM's next step (e.g.
                     "tcp://*:5557"; vLLM's --kv-events-config endpoint then binds where the
                     connector relays it from, e.g. "inproc://vllm-kv-events"; tpusync.engines.connector.relay)

The `kv_transfer_params` a prefill engine answers with and the one parser of what a decode engine
is sent are the prefill-to-decode contract, `tpusync.kv.handoff`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tpusync import errors
from tpusync.kv.handoff import split_literal
from tpusync.kv.keys import DEFAULT_SEED

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
        if cfg.data_address is not None and split_literal(str(cfg.data_address)) is None:
            # Decode engines refuse a hand-off naming anything else (tpusync.kv.handoff): say so now.
            raise errors.InvalidArgumentError(f"data_address must be a literal ip:port (the pod's IP), not "
                                              f"{cfg.data_address!r}")
        return cfg


def flag(value: Any) -> bool:
    """A boolean option: true, false, or a string such as "0", "off", "yes"."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(value)
