"""KV events for llm-d's precise prefix-cache routing, in vLLM's wire format.

Each message is three ZMQ frames: the topic, a sequence number (uint64 big-endian), and a
msgpack payload `[timestamp, [event, ...], data_parallel_rank]`. Events are positional
arrays tagged by name:
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
  ["BlockRemoved", block_hashes, medium]
  ["AllBlocksCleared"]
Block hashes are the 64-bit forms of tpusync's block keys (tpusync.hashing.event_hash_of), so
the router's index and the store agree on what a block is. `medium` says which tier holds
the block: "CPU" for host DRAM, "DISK" for the disk tier.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Sequence

import msgpack
import zmq


class KVEventPublisher:
    """Publishes KV events on a ZMQ PUB socket. Thread-safe.

    `endpoint` like "tcp://*:5557" binds (llm-d's per-pod mode); "tcp://host:port" connects
    (to a central collector). `topic` is conventionally "kv@<pod-ip>:<port>@<model>".
    """

    def __init__(self, endpoint: str, topic: str, *, dp_rank: int = 0):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
        if host in ("*", "0.0.0.0", "127.0.0.1", "[::]"):
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self._seq = 0
        self._lock = threading.Lock()

    def _send(self, events: list[list]) -> None:
        payload = msgpack.packb([time.time(), events, self.dp_rank], use_bin_type=True)
        with self._lock:
            self._sock.send_multipart([self.topic, struct.pack(">Q", self._seq), payload])
            self._seq += 1

    def block_stored(self, block_hashes: Sequence[int], parent_hash: int | None, token_ids: Sequence[int],
                     block_size: int, *, medium: str = "CPU", lora_id: int | None = None) -> None:
        self._send([["BlockStored", list(block_hashes), parent_hash, list(token_ids), block_size, lora_id, medium]])

    def block_removed(self, block_hashes: Sequence[int], *, medium: str = "CPU") -> None:
        self._send([["BlockRemoved", list(block_hashes), medium]])

    def all_cleared(self) -> None:
        self._send([["AllBlocksCleared"]])

    def close(self) -> None:
        self._sock.close(linger=0)
