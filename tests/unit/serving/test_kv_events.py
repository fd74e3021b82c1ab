"""KV events in vLLM's format, received by a real ZMQ SUB socket."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import zmq

import tpusync
from tpusync.hashing import BlockHasher, event_hash_of
from tpusync.kv_events import KVEventPublisher
from tpusync.serving.engine import Engine
from tpusync.serving.model import ModelConfig


def subscriber(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, 10000)
    sub.connect(endpoint)
    return sub


def wait_connected(pub: KVEventPublisher, sub: zmq.Socket) -> None:
    """PUB drops messages until the subscription arrives: publish probes until one is seen."""
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    for _ in range(500):
        pub.all_cleared()
        if poller.poll(20):
            sub.recv_multipart()
            while poller.poll(0):
                sub.recv_multipart()
            return
    raise AssertionError("subscriber never connected")


def test_engine_publishes_block_stored_with_the_router_hashes():
    cfg = ModelConfig(max_seq=512, layers=2, d_model=128, mlp=256)
    pub = KVEventPublisher("tcp://127.0.0.1:0", "kv@10.0.0.1:8000@m")
    sub = subscriber(pub.endpoint)
    wait_connected(pub, sub)
    prompt = np.random.default_rng(0).integers(0, 256, 100).tolist()
    with tpusync.KVStore.local(dram_bytes=4 << 20, block_bytes=cfg.page_bytes) as store:
        Engine(cfg, store=store, kv_events=pub).generate(prompt, 2)
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv@10.0.0.1:8000@m"
    assert struct.unpack(">Q", seq)[0] >= 1
    ts, events, dp_rank = msgpack.unpackb(payload)
    assert dp_rank == 0 and isinstance(ts, float)
    (tag, hashes, parent, tokens, block_size, lora_id, medium), = events
    digests = BlockHasher(cfg.page_size).digests(prompt)
    assert tag == "BlockStored" and medium == "CPU" and block_size == 32 and lora_id is None
    assert hashes == [event_hash_of(d) for d in digests] and parent is None
    assert tokens == prompt[:96]
    pub.close()
    sub.close()
