"""The relay that publishes the connector's KV events between those of vLLM's own publisher on
the router's endpoint (tpusync.engines.connector.relay), on real ZMQ sockets: vLLM's ZmqEventPublisher as
the engine's, a SUB socket as llm-d's indexer, vLLM's decoder reading what it receives."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from harness.polling import wait_for
from tpusync import errors
from tpusync.engines.connector.relay import reachable, relay_for

TOPIC = "kv@10.0.0.7:8000@tiny"


def events_config(endpoint: str, **kw) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=TOPIC, **kw)


def test_the_router_receives_both_streams_on_one_endpoint_in_one_sequence(tmp_path: Path) -> None:
    engine = ZmqEventPublisher(0, endpoint="inproc://test-vllm-kv-events", topic=TOPIC)  # as vLLM's scheduler has it
    cleared = threading.Event()
    relay = relay_for(f"ipc://{tmp_path}/events", events_config("inproc://test-vllm-kv-events"), 0, cleared.set)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(relay.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    seqs: list[int] = []
    seen: dict[str, set[int]] = {"GPU": set(), "CPU": set()}

    def publish() -> None:  # again until the router's subscription is in place
        engine.publish(KVEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None, medium="GPU",
            lora_name=None)]))
        relay.send([BlockRemoved(block_hashes=[2], medium="CPU")])

    def both() -> bool:
        while sub.poll(0):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode()
            seqs.append(int.from_bytes(seq, "big"))
            for event in decoder.decode(payload).events:
                seen[event.medium].update(event.block_hashes)
        return all(seen.values())

    try:
        wait_for("both streams at the relay's endpoint", both, 10, interval=0.02, step=publish)
        assert seen == {"GPU": {1}, "CPU": {2}}
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one sequence, no gap
        assert not cleared.is_set()
        engine.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))  # a prefix-cache reset
        assert cleared.wait(10)
    finally:
        sub.close(linger=0)
        relay.stop()
        engine.shutdown()
    assert not relay._thread.is_alive()
    for _ in range(2000):  # past the queue's high-water mark: a stopped relay never blocks the scheduler
        relay.send([BlockRemoved(block_hashes=[3], medium="CPU")])


@pytest.mark.parametrize("endpoint, want", [
    ("inproc://vllm-kv-events", "inproc://vllm-kv-events"),
    ("ipc:///run/vllm-kv-events", "ipc:///run/vllm-kv-events"),
    ("tcp://*:5557", "tcp://127.0.0.1:5557"),
    ("tcp://[::]:5557", "tcp://[::1]:5557"),
])
def test_the_relay_reaches_vllms_publisher_where_it_binds(endpoint: str, want: str) -> None:
    assert reachable(endpoint) == want


@pytest.mark.parametrize("config", [
    events_config("tcp://collector:5557"),  # vLLM would connect, not bind
    events_config("tcp://*:0"),
    events_config("inproc://e", replay_endpoint="tcp://*:5558"),
    KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
])
def test_a_vllm_publisher_the_relay_cannot_serve_is_refused(config: KVEventsConfig, tmp_path: Path) -> None:
    with pytest.raises(errors.InvalidArgumentError, match="kv_events_endpoint"):
        relay_for(f"ipc://{tmp_path}/events", config, 0, lambda: None)


def test_a_busy_endpoint_fails_the_connector_with_its_name() -> None:
    taken = zmq.Context.instance().socket(zmq.PUB)
    taken.bind("tcp://127.0.0.1:0")
    busy = taken.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        with pytest.raises(errors.InvalidArgumentError, match=busy):
            relay_for(busy, events_config("inproc://busy-vllm"), 0, lambda: None)
    finally:
        taken.close(linger=0)
