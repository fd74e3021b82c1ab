"""KV events for llm-d's precise prefix-cache routing, in vLLM's wire format.

Each message is three ZMQ frames: the topic, a sequence number (uint64 big-endian), and a
msgpack payload `[timestamp, [event, ...], data_parallel_rank]`. Events are positional
arrays tagged by name:
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
  ["BlockRemoved", block_hashes, medium]
  ["AllBlocksCleared"]
Block hashes are the 64-bit forms of tpusync's block keys (tpusync.hashing.event_hash_of): to
llm-d (v0.9.0) they are opaque engine keys, mapped to the keys it computes itself from each
event's token ids (docs/block-keys.md). `medium` says which tier holds the block: "CPU" for
host DRAM, "DISK" for the disk tier; llm-d keeps it, lower-cased, as the block's tier.
"""

from __future__ import annotations

import struct
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import zmq


def block_stored(block_hashes: Sequence[int], parent_hash: int | None, token_ids: Sequence[int], block_size: int,
                 *, medium: str = "CPU", lora_id: int | None = None) -> list:
    return ["BlockStored", list(block_hashes), parent_hash, list(token_ids), block_size, lora_id, medium]


def block_removed(block_hashes: Sequence[int], *, medium: str = "CPU") -> list:
    return ["BlockRemoved", list(block_hashes), medium]


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

    def send(self, events: list[list]) -> int:
        """Publishes one batch of events; returns its sequence number."""
        payload = msgpack.packb([time.time(), events, self.dp_rank], use_bin_type=True)
        with self._lock:
            seq = self._seq
            self._sock.send_multipart([self.topic, struct.pack(">Q", seq), payload])
            self._seq += 1
        return seq

    def block_stored(self, block_hashes: Sequence[int], parent_hash: int | None, token_ids: Sequence[int],
                     block_size: int, *, medium: str = "CPU", lora_id: int | None = None) -> int:
        return self.send([block_stored(block_hashes, parent_hash, token_ids, block_size, medium=medium,
                                       lora_id=lora_id)])

    def block_removed(self, block_hashes: Sequence[int], *, medium: str = "CPU") -> int:
        return self.send([block_removed(block_hashes, medium=medium)])

    def all_cleared(self) -> int:
        return self.send([["AllBlocksCleared"]])

    def close(self) -> None:
        self._sock.close(linger=0)


_MEDIA_BITS = (("CPU", 1), ("DISK", 2))  # tpusync.store.Tier codes are bit sets: DRAM 1, DISK 2
_EVERY = frozenset(m for m, _ in _MEDIA_BITS)


def _media(tier: int) -> frozenset[str]:
    return frozenset(m for m, bit in _MEDIA_BITS if int(tier) & bit)


@dataclass
class _Block:
    key: int                  # the store key, to ask the store where the block is
    parent: int | None        # the event hash of the block before it
    tokens: array             # its token ids, to announce it again on another tier
    media: frozenset[str]     # where llm-d was last told it is


class BlockAnnouncer:
    """Keeps llm-d's index of one engine's blocks true to what its store holds. Thread-safe.

    After each request the engine passes the prompt's full blocks and where its store holds
    them (`tiers`: tpusync.store.Tier codes, `held`: the leading blocks it can load). Every held
    block is announced from the first one (BlockStored, one event per run of blocks on the same
    tier, so each event's parent is in an earlier one), whatever happened to it before: computed
    here, pulled from a peer, received by P/D, or restored by the sidecar after a restart. A
    tier the block left, or a block past the held prefix, is withdrawn (BlockRemoved) when this
    engine announced it there, or may have (before this process started).

    The sidecar demotes and evicts blocks on its own; `audit` (the engine calls it every few
    seconds) asks the store where the remembered blocks are now and announces the changes.
    """

    def __init__(self, publisher: KVEventPublisher, block_size: int, *, remember: int = 1 << 16):
        self.publisher, self.block_size, self.remember = publisher, block_size, remember
        self._blocks: dict[int, _Block] = {}  # event hash -> block, least recently served first
        self._lock = threading.Lock()

    def announce(self, hashes: Sequence[int], keys: Sequence[int], tokens: Sequence[int], tiers: Sequence[int],
                 held: int) -> int | None:
        """Publishes the events for one prompt; returns the batch's sequence number (None: nothing to say)."""
        media = [_media(tiers[i]) if i < held else frozenset() for i in range(len(hashes))]
        events = []
        for name, _ in _MEDIA_BITS:  # runs of consecutive held blocks on one medium
            start = None
            for i in range(held + 1):
                on = i < held and name in media[i]
                if on and start is None:
                    start = i
                elif not on and start is not None:
                    events.append((start, block_stored(
                        hashes[start:i], hashes[start - 1] if start else None,
                        tokens[start * self.block_size:i * self.block_size], self.block_size, medium=name)))
                    start = None
        events.sort(key=lambda e: e[0])  # a run's parent lies in a run that starts earlier
        batch = [e for _, e in events]
        with self._lock:
            known = [self._blocks.get(h) for h in hashes]
            for name, _ in _MEDIA_BITS:
                gone = [h for h, m, b in zip(hashes, media, known)
                        if name not in m and name in (b.media if b else _EVERY)]
                if gone:
                    batch.append(block_removed(gone, medium=name))
            for i, h in enumerate(hashes):
                self._blocks.pop(h, None)
                b = self.block_size
                self._blocks[h] = _Block(keys[i], hashes[i - 1] if i else None, array("I", tokens[i * b:(i + 1) * b]),
                                         media[i])
            while len(self._blocks) > self.remember:
                del self._blocks[next(iter(self._blocks))]
            return self.publisher.send(batch) if batch else None

    def audit(self, lookup) -> int | None:
        """Asks the store where the remembered blocks are (`lookup(keys)` -> Tier codes per key)
        and announces what changed since; returns the batch's sequence number, None if nothing did."""
        with self._lock:  # held across the lookup: an announce in between would be overwritten
            items = list(self._blocks.items())
            if not items:
                return None
            tiers = lookup([b.key for _, b in items])
            batch = []
            for name, _ in _MEDIA_BITS:
                gone = []
                for (h, b), t in zip(items, tiers):
                    now = _media(t)
                    if name in now and name not in b.media:  # e.g. written behind to disk
                        batch.append(block_stored([h], b.parent, b.tokens.tolist(), self.block_size, medium=name))
                    elif name in b.media and name not in now:  # evicted, or dropped by the store
                        gone.append(h)
                if gone:
                    batch.append(block_removed(gone, medium=name))
            for (h, b), t in zip(items, tiers):
                b.media = _media(t)
            return self.publisher.send(batch) if batch else None
