"""The pod's KV-events endpoint when the connector publishes on its own (`kv_events_endpoint`).

vLLM publishes its events, the connector's included, only when its engine steps: an idle engine
would keep what the sidecar demoted or evicted until its next request, and the router would keep
scoring blocks that are gone. With `kv_events_endpoint` the connector's events go out the moment
it has them, and `tpusync.kv.relay.EventRelay` puts them on the one endpoint the router
subscribes to, between the messages of vLLM's own publisher, which it forwards: one stream, one
sequence of numbers, in vLLM's wire format (vLLM's `KVEventBatch`, encoded by msgspec as vLLM's
publisher does).

vLLM's publisher must then bind somewhere the relay can reach (`inproc://…`, which needs no
port or file; `ipc://…`; or `tcp://*:port`), not connect to a collector. An `AllBlocksCleared`
of vLLM's (a prefix-cache reset) makes llm-d forget every tier of the pod, the connector's
too; the relay reports each one it forwards (`on_cleared`), so the connector announces again
what the store still holds for the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher

from tpusync import errors
from tpusync.engines.connector.common import log
from tpusync.kv import relay as event_relay

if TYPE_CHECKING:
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import KVCacheEvent

_CLEARED_TAG = AllBlocksCleared.__name__.encode()
_SETTING = "kv_events_endpoint"


def reachable(endpoint: str) -> str:
    """Where a socket in this process connects to reach vLLM's publisher bound at `endpoint`."""
    if not ZmqEventPublisher._is_bind_endpoint(endpoint):
        raise errors.InvalidArgumentError(
            f"{_SETTING} relays vLLM's publisher, which must bind (inproc://…, ipc://… or tcp://*:port), "
            f"not connect to {endpoint!r}: set --kv-events-config endpoint to one")
    return event_relay.reachable(endpoint, setting=_SETTING)


def relay_for(public: str, vllm_events: KVEventsConfig, dp_rank: int, on_cleared: Callable[[], None]) -> EventRelay:
    """The relay of one engine (its data-parallel rank offsets both endpoints, as vLLM offsets its own)."""
    if vllm_events.publisher != "zmq":
        raise errors.InvalidArgumentError(f"{_SETTING} needs vLLM's zmq KV-events publisher, "
                                          f"not {vllm_events.publisher!r}")
    if vllm_events.replay_endpoint:
        raise errors.InvalidArgumentError(f"{_SETTING} renumbers vLLM's batches, so vLLM's replay_endpoint "
                                          "would replay other numbers: leave it unset")
    offset = ZmqEventPublisher.offset_endpoint_port
    return EventRelay(offset(public, dp_rank) or public, reachable(offset(vllm_events.endpoint, dp_rank) or ""),
                      topic=vllm_events.topic, dp_rank=dp_rank, on_cleared=on_cleared)


class EventRelay(event_relay.EventRelay):
    """The relay in vLLM's wire format: `send` encodes the connector's events as vLLM's
    publisher does, and every AllBlocksCleared of vLLM's calls `on_cleared` (on the relay's thread)."""

    def __init__(self, public: str, engine: str, *, topic: str, dp_rank: int,
                 on_cleared: Callable[[], None]) -> None:
        self._dp_rank, self._on_cleared = dp_rank, on_cleared
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVEventBatch)
        super().__init__(public, engine, topic=topic, on_forwarded=self._forwarded)

    def send(self, events: list[KVCacheEvent]) -> None:
        """Publishes one batch of the connector's, after what the relay has forwarded so far."""
        self.publish(self._encoder.encode(KVEventBatch(ts=time.time(), events=events,
                                                       data_parallel_rank=self._dp_rank)))

    def _forwarded(self, payload: bytes) -> None:
        if _CLEARED_TAG not in payload:  # msgspec writes the tag of every event: most batches end here
            return
        try:
            cleared = any(isinstance(e, AllBlocksCleared) for e in self._decoder.decode(payload).events)
        except msgspec.DecodeError as e:
            log.warning("tpusync KV events relay cannot read a batch of vLLM's: %s", e)
            return
        if cleared:
            self._on_cleared()
