"""The pod's KV-events relay, engine-agnostic: where it reaches an engine's publisher, and that it
carries the engine's messages and tpusync's in one renumbered sequence (real ZMQ sockets)."""

from __future__ import annotations

import uuid

import pytest
import zmq

from harness.polling import wait_for
from tpusync import errors
from tpusync.kv.relay import EventRelay, reachable


@pytest.mark.parametrize(("endpoint", "want"), [
    ("inproc://engine", "inproc://engine"),
    ("ipc:///run/engine-events", "ipc:///run/engine-events"),
    ("tcp://*:5557", "tcp://127.0.0.1:5557"),
    ("tcp://0.0.0.0:5557", "tcp://127.0.0.1:5557"),
    ("tcp://[::]:5557", "tcp://[::1]:5557"),
    ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:5558"),  # SGLang's "bind": true on loopback
])
def test_the_relay_reaches_a_publisher_where_it_binds(endpoint: str, want: str) -> None:
    assert reachable(endpoint, setting="x") == want


@pytest.mark.parametrize("endpoint", ["tcp://collector:5557", "tcp://*:0", "tcp://127.0.0.1:0", "udp://*:1", "ipc://"])
def test_a_publisher_that_connects_or_has_no_port_is_refused_with_the_setting(endpoint: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=r"kv_events\.engine_endpoint"):
        reachable(endpoint, setting="kv_events.engine_endpoint")


def test_engine_messages_and_tpusyncs_leave_in_one_sequence() -> None:
    ctx = zmq.Context.instance()
    engine_endpoint, public = f"inproc://engine-{uuid.uuid4().hex}", f"inproc://pod-{uuid.uuid4().hex}"
    engine = ctx.socket(zmq.PUB)
    engine.bind(engine_endpoint)
    forwarded: list[bytes] = []
    relay = EventRelay(public, engine_endpoint, topic="kv@pod@m", on_forwarded=forwarded.append)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(public)
    try:
        got: list[list[bytes]] = []

        def received(payload: bytes) -> bool:
            while sub.poll(10):
                got.append(sub.recv_multipart())
            return any(m[2] == payload for m in got)

        # PUB drops what it sends before a subscription arrives: both senders repeat until one shows.
        wait_for("the relay to forward the engine's", lambda: received(b"engine"), 10, interval=0.01,
                 step=lambda: engine.send_multipart([b"kv@pod@m", (7).to_bytes(8, "big"), b"engine"]))
        wait_for("the relay to publish tpusync's", lambda: received(b"ours"), 10, interval=0.01,
                 step=lambda: relay.publish(b"ours"))
        assert [int.from_bytes(m[1], "big") for m in got] == list(range(len(got)))  # renumbered, gapless
        assert {m[0] for m in got} == {b"kv@pod@m"} and b"engine" in forwarded and b"ours" not in forwarded
        engine.send_multipart([b"only-two-frames", b"x"])  # not [topic, seq, payload]: dropped, relay lives on
        relay.publish(b"after")
        wait_for("the relay to go on", lambda: received(b"after"), 10, interval=0.01)
    finally:
        sub.close(linger=0)
        relay.stop()
        engine.close(linger=0)
