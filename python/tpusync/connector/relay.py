"""The pod's KV-events endpoint when the connector publishes on its own (`kv_events_endpoint`).

vLLM publishes its events, the connector's included, only when its engine steps: an idle engine
would keep what the sidecar demoted or evicted until its next request, and the router would keep
scoring blocks that are gone. With `kv_events_endpoint` the connector's events go out the moment
it has them, and `EventRelay` puts them on the one endpoint the router subscribes to, between
the messages of vLLM's own publisher, which it forwards: one stream, one sequence of numbers,
in vLLM's wire format (vLLM's `KVEventBatch`, encoded by msgspec as vLLM's publisher does).

vLLM's publisher must then bind somewhere the relay can reach (`inproc://…`, which needs no
port or file; `ipc://…`; or `tcp://*:port`), not connect to a collector. An `AllBlocksCleared`
of vLLM's (a prefix-cache reset) makes llm-d forget every tier of the pod, the connector's
too; the relay reports each one it forwards (`on_cleared`), so the connector announces again
what the store still holds for the engine.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher

from tpusync import errors
from tpusync.connector.common import log

if TYPE_CHECKING:
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import KVCacheEvent

_BATCH, _STOP = b"batch", b"stop"
_CLEARED_TAG = AllBlocksCleared.__name__.encode()


def reachable(endpoint: str) -> str:
    """Where a socket in this process connects to reach a publisher bound at `endpoint`."""
    if not ZmqEventPublisher._is_bind_endpoint(endpoint):
        raise errors.InvalidArgumentError(
            f"kv_events_endpoint relays vLLM's publisher, which must bind (inproc://…, ipc://… or tcp://*:port), "
            f"not connect to {endpoint!r}: set --kv-events-config endpoint to one")
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if port == "0":
            raise errors.InvalidArgumentError("kv_events_endpoint cannot relay a vLLM publisher on tcp port 0")
        return f"tcp://{'[::1]' if '::' in host else '127.0.0.1'}:{port}"
    return endpoint


def relay_for(public: str, vllm_events: KVEventsConfig, dp_rank: int, on_cleared: Callable[[], None]) -> EventRelay:
    """The relay of one engine (its data-parallel rank offsets both endpoints, as vLLM offsets its own)."""
    if vllm_events.publisher != "zmq":
        raise errors.InvalidArgumentError(f"kv_events_endpoint needs vLLM's zmq KV-events publisher, "
                                          f"not {vllm_events.publisher!r}")
    if vllm_events.replay_endpoint:
        raise errors.InvalidArgumentError("kv_events_endpoint renumbers vLLM's batches, so vLLM's replay_endpoint "
                                          "would replay other numbers: leave it unset")
    offset = ZmqEventPublisher.offset_endpoint_port
    return EventRelay(offset(public, dp_rank) or public, reachable(offset(vllm_events.endpoint, dp_rank) or ""),
                      topic=vllm_events.topic, dp_rank=dp_rank, on_cleared=on_cleared)


class EventRelay:
    """Publishes on `public` (bound here, so a bad or busy endpoint fails the connector's
    construction) what vLLM's publisher at `engine` sends and what `send` is given, in the order
    they reach it. `send` is thread-safe; the sockets but the inbox's sender are the relay thread's."""

    def __init__(self, public: str, engine: str, *, topic: str, dp_rank: int,
                 on_cleared: Callable[[], None]) -> None:
        # vLLM's publisher's context too: an inproc:// engine endpoint needs the one context.
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        inbox = f"inproc://tpusync-kv-events-{uuid.uuid4().hex}"
        self._pub, self._engine = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        self._inbox, self._outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        try:
            self._pub.bind(public)
            self._engine.setsockopt(zmq.SUBSCRIBE, b"")  # all of it: the router's subscriptions filter at _pub
            self._engine.connect(engine)  # before vLLM's publisher binds is fine: ZMQ retries
            self._inbox.bind(inbox)
            self._outbox.connect(inbox)
        except zmq.ZMQError as e:
            self._close()
            raise errors.InvalidArgumentError(f"kv_events_endpoint {public!r}: {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic, self._dp_rank, self._on_cleared = topic.encode(), dp_rank, on_cleared
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVEventBatch)
        self._lock = threading.Lock()  # the outbox, for every thread that sends
        self._seq = 0
        self._dropped = 0
        # Sockets may change threads across a memory barrier; starting the thread is one.
        self._thread = threading.Thread(target=self._run, daemon=True, name="tpusync-kv-events-relay")
        self._thread.start()

    def send(self, events: list[KVCacheEvent]) -> None:
        """Publishes one batch of the connector's, after what the relay has forwarded so far."""
        with self._lock:
            payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events,
                                                        data_parallel_rank=self._dp_rank))
            self._put([_BATCH, payload])

    def stop(self) -> None:
        """Publishes what was sent before, then closes the endpoint."""
        with self._lock:
            self._put([_STOP])
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._close()

    def _put(self, frames: list[bytes]) -> None:
        # Never blocks: the caller may be the engine's scheduler thread, and a relay that stopped
        # (or lags a full queue behind) must not stop the engine.
        try:
            self._outbox.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # zmq.Again: a full queue; ENOTSOCK: stopped
            self._dropped += 1
            if self._dropped & (self._dropped - 1) == 0:  # the 1st, 2nd, 4th...
                log.warning("tpusync KV events relay dropped %d batches of the connector's: %s", self._dropped, e)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        poller.register(self._engine, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is self._inbox:
                        kind, *payload = self._inbox.recv_multipart()
                        if kind == _STOP:
                            return
                        self._publish(self._topic, payload[0])
                    else:
                        self._forward(self._engine.recv_multipart())
        except zmq.ZMQError as e:  # the context went away under it (interpreter exit)
            log.warning("tpusync KV events relay stopped: %s", e)

    def _forward(self, frames: list[bytes]) -> None:
        if len(frames) != 3:  # not vLLM's [topic, sequence, payload]
            log.warning("tpusync KV events relay dropped a %d-frame message from vLLM's publisher", len(frames))
            return
        topic, _, payload = frames
        self._publish(topic, payload)
        if _CLEARED_TAG not in payload:  # msgspec writes the tag of every event: most batches end here
            return
        try:
            cleared = any(isinstance(e, AllBlocksCleared) for e in self._decoder.decode(payload).events)
        except msgspec.DecodeError as e:
            log.warning("tpusync KV events relay cannot read a batch of vLLM's: %s", e)
            return
        if cleared:
            self._on_cleared()

    def _publish(self, topic: bytes, payload: bytes) -> None:
        self._pub.send_multipart([topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def _close(self) -> None:
        for sock in (self._pub, self._engine, self._inbox, self._outbox):
            sock.close(linger=0)
