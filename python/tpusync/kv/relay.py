"""One KV-events endpoint per pod, carrying an engine's own events and tpusync's.

llm-d subscribes to one endpoint per pod (one sequence of numbers). An engine publishes what
its device (and host) caches hold; tpusync's tiers are announced by tpusync. `EventRelay` binds
the pod's endpoint, forwards every message of the engine's publisher (which must bind somewhere
the relay can reach: `inproc://…`, `ipc://…` or `tcp://*:port`) and publishes tpusync's
batches between them, renumbering the whole stream. The payloads are the engine's own wire
format: each engine's adapter encodes tpusync's events with the engine's own structs
(`tpusync.engines.connector.relay` for vLLM, `tpusync.engines.sglang.events` for SGLang).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import zmq

from tpusync import errors

log = logging.getLogger(__name__)

_BATCH, _STOP = b"batch", b"stop"
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
_LOOPBACK_HOSTS = ("127.0.0.1", "[::1]", "localhost")


def reachable(endpoint: str, *, setting: str) -> str:
    """Where a socket in this process connects to reach a publisher bound at `endpoint`
    (`setting`: the option that asked for the relay, named in errors)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("inproc", "ipc") and rest:
        return endpoint
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and host in _LOOPBACK_HOSTS and port.isdigit() and port != "0":
        return endpoint  # bound on loopback (SGLang's "bind": true): the pod network never sees it
    if scheme != "tcp" or host not in _WILDCARD_HOSTS or not port.isdigit():
        raise errors.InvalidArgumentError(
            f"{setting} relays the engine's KV-events publisher, which must bind (inproc://…, ipc://…, "
            f"tcp://*:port or a loopback tcp address), not connect to {endpoint!r}: set the engine's KV-events "
            f"endpoint to one")
    if port == "0":
        raise errors.InvalidArgumentError(f"{setting} cannot relay an engine publisher on tcp port 0")
    return f"tcp://{'[::1]' if ':' in host else '127.0.0.1'}:{port}"


class EventRelay:
    """Publishes on `public` (bound here, so a bad or busy endpoint fails at construction) what
    the engine's publisher at `engine` sends and what `publish` is given, in the order they reach
    it. `on_forwarded` sees each payload of the engine's, on the relay's thread. `publish` is
    thread-safe; the sockets but the inbox's sender are the relay thread's."""

    def __init__(self, public: str, engine: str, *, topic: str,
                 on_forwarded: Callable[[bytes], None] | None = None) -> None:
        # The engine's publisher's context too: an inproc:// engine endpoint needs the one context.
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        inbox = f"inproc://tpusync-kv-events-{uuid.uuid4().hex}"
        self._pub, self._engine = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
        self._inbox, self._outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        try:
            self._pub.bind(public)
            self._engine.setsockopt(zmq.SUBSCRIBE, b"")  # all of it: the router's subscriptions filter at _pub
            self._engine.connect(engine)  # before the engine's publisher binds is fine: ZMQ retries
            self._inbox.bind(inbox)
            self._outbox.connect(inbox)
        except zmq.ZMQError as e:
            self._close()
            raise errors.InvalidArgumentError(f"KV-events endpoint {public!r}: {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic, self._on_forwarded = topic.encode(), on_forwarded
        self._lock = threading.Lock()  # the outbox, for every thread that sends
        self._seq = 0
        self._dropped = 0
        # Sockets may change threads across a memory barrier; starting the thread is one.
        self._thread = threading.Thread(target=self._run, daemon=True, name="tpusync-kv-events-relay")
        self._thread.start()

    def publish(self, payload: bytes) -> None:
        """Publishes one batch of tpusync's (encoded), after what the relay has forwarded so far."""
        with self._lock:
            self._put([_BATCH, payload])

    def stop(self) -> None:
        """Publishes what was given before, then closes the endpoint."""
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
                log.warning("tpusync KV events relay dropped %d batches of tpusync's: %s", self._dropped, e)

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
                        self._send(self._topic, payload[0])
                    else:
                        self._forward(self._engine.recv_multipart())
        except zmq.ZMQError as e:  # the context went away under it (interpreter exit)
            log.warning("tpusync KV events relay stopped: %s", e)

    def _forward(self, frames: list[bytes]) -> None:
        if len(frames) != 3:  # not [topic, sequence, payload]
            log.warning("tpusync KV events relay dropped a %d-frame message from the engine's publisher",
                        len(frames))
            return
        topic, _, payload = frames
        self._send(topic, payload)
        if self._on_forwarded is not None:
            self._on_forwarded(payload)

    def _send(self, topic: bytes, payload: bytes) -> None:
        self._pub.send_multipart([topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def _close(self) -> None:
        for sock in (self._pub, self._engine, self._inbox, self._outbox):
            sock.close(linger=0)
