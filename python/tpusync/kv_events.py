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
host DRAM, "DISK" for the disk tier, "SHARED_STORAGE" for the shared tier (vLLM's and
upstream TPU Sync's name for it); llm-d keeps it, lower-cased, as the block's tier.
"""

from __future__ import annotations

import struct
import threading
import time
from array import array
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import zmq

if TYPE_CHECKING:
    from tpusync.store import KVStore

Event = list[Any]  # one positional event, as above


def block_stored(block_hashes: Sequence[int], parent_hash: int | None, token_ids: Sequence[int], block_size: int,
                 *, medium: str = "CPU", lora_id: int | None = None) -> Event:
    return ["BlockStored", list(block_hashes), parent_hash, list(token_ids), block_size, lora_id, medium]


def block_removed(block_hashes: Sequence[int], *, medium: str = "CPU") -> Event:
    return ["BlockRemoved", list(block_hashes), medium]


class EventSink(Protocol):
    """Where a BlockAnnouncer sends its batches: a KVEventPublisher, or an engine's own publisher
    through an adapter (tpusync.vllm.events). `send` returns the batch's sequence number if known."""

    def send(self, events: list[Event]) -> int | None: ...


class KVEventPublisher:
    """Publishes KV events on a ZMQ PUB socket. Thread-safe.

    `endpoint` like "tcp://*:5557" binds (llm-d's per-pod mode); "tcp://host:port" connects
    (to a central collector). `topic` is conventionally "kv@<pod-ip>:<port>@<model>".
    """

    def __init__(self, endpoint: str, topic: str, *, dp_rank: int = 0) -> None:
        import msgpack  # here: engines that publish through their own publisher (vLLM's) lack msgpack

        self._pack = msgpack.Packer(use_bin_type=True)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
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

    def send(self, events: list[Event]) -> int:
        """Publishes one batch of events; returns its sequence number."""
        with self._lock:
            payload = self._pack.pack([time.time(), events, self.dp_rank])
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


# tpusync.store.Tier codes are bit sets: DRAM 1, DISK 2, SHARED 4 (held only there)
_MEDIA_BITS = (("CPU", 1), ("DISK", 2), ("SHARED_STORAGE", 4))
_EVERY = frozenset(m for m, _ in _MEDIA_BITS)


def _media(tier: int) -> frozenset[str]:
    return frozenset(m for m, bit in _MEDIA_BITS if int(tier) & bit)


@dataclass
class _Block:
    key: int                  # the store key, to ask the store where the block is
    parent: int | None        # the event hash of the block before it
    tokens: array[int]        # its token ids, to announce it again on another tier
    media: frozenset[str]     # where llm-d was last told it is


class BlockAnnouncer:
    """Keeps llm-d's index of one engine's blocks true to what its store holds. Thread-safe.

    The one implementation of "what to announce" for every engine tpusync serves: the reference
    server (`tpusync.serving`) sends its batches to a KVEventPublisher, vLLM's and tpu-inference's
    connector to vLLM's own publisher (`tpusync.vllm.events`).

    After each request the engine passes the prompt's full blocks and where its store holds
    them (`tiers`: tpusync.store.Tier codes, `held`: the leading blocks it can load). Every held
    block is announced from the first one (BlockStored, one event per run of blocks on the same
    tier, so each event's parent is in an earlier one), whatever happened to it before: computed
    here, pulled from a peer, received by P/D, or restored by the sidecar after a restart. A
    tier the block left, or a block past the held prefix, is withdrawn (BlockRemoved) when this
    engine announced it there, or may have (before this process started).

    The sidecar demotes and evicts blocks on its own; `audit` asks the store where the
    remembered blocks are now and announces the changes: for the keys of the store's change
    feed as it reports them (`follow`), or for every remembered block on a timer.
    """

    def __init__(self, publisher: EventSink, block_size: int, *, remember: int = 1 << 16) -> None:
        self.publisher, self.block_size, self.remember = publisher, block_size, remember
        self._blocks: dict[int, _Block] = {}  # event hash -> block, least recently served first
        self._by_key: dict[int, int] = {}     # store key -> event hash, of the blocks above
        self._lock = threading.Lock()

    def announce(self, hashes: Sequence[int], keys: Sequence[int], tokens: Sequence[int], tiers: Sequence[int],
                 held: int) -> int | None:
        """Publishes the events for one prompt; returns the batch's sequence number (None: nothing to
        say, or a sink that does not number batches)."""
        media = [_media(tiers[i]) if i < held else frozenset() for i in range(len(hashes))]
        events: list[tuple[int, Event]] = []
        for name, _ in _MEDIA_BITS:  # runs of consecutive held blocks on one medium
            start: int | None = None
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
                self._by_key[keys[i]] = h
            while len(self._blocks) > self.remember:
                self._by_key.pop(self._blocks.pop(next(iter(self._blocks))).key, None)
            # Sent under the lock: batches leave in the order the announcer's state changed.
            return self.publisher.send(batch) if batch else None

    def cleared(self) -> None:
        """The index forgot every block of this engine (the engine's AllBlocksCleared): the next
        audit announces each remembered block again, wherever the store still holds it."""
        with self._lock:
            for b in self._blocks.values():
                b.media = frozenset()

    def audit(self, lookup: Callable[[list[int]], Sequence[int]], keys: Collection[int] | None = None) -> int | None:
        """Asks the store where the remembered blocks are (`lookup(keys)` -> Tier codes per key)
        and announces what changed since; returns the batch's sequence number, None if nothing did.
        `keys`: only the remembered blocks of these store keys (a change feed's batch).

        The lookup runs without the lock, so an engine announcing a request never waits for it;
        a block announced again meanwhile is left to that newer announcement."""
        with self._lock:
            if keys is None:
                items = list(self._blocks.items())
            else:
                hashes = {h for k in keys if (h := self._by_key.get(k)) is not None}
                items = [(h, self._blocks[h]) for h in hashes]
        if not items:
            return None
        tiers = lookup([b.key for _, b in items])
        with self._lock:
            now = [(h, b, _media(t)) for (h, b), t in zip(items, tiers) if self._blocks.get(h) is b]
            batch: list[Event] = []
            for name, _ in _MEDIA_BITS:
                stored = {h: b for h, b, media in now if name in media and name not in b.media}  # e.g. demoted
                for h in _parents_first(stored):
                    b = stored[h]
                    batch.append(block_stored([h], b.parent, b.tokens.tolist(), self.block_size, medium=name))
                gone = [h for h, b, media in now if name in b.media and name not in media]  # evicted, dropped
                if gone:
                    batch.append(block_removed(gone, medium=name))
            for _, b, media in now:
                b.media = media
            return self.publisher.send(batch) if batch else None


def follow(announcer: BlockAnnouncer, store: KVStore, stop: threading.Event, *, wait_s: float = 1.0) -> None:
    """Announces what the store's change feed reports as it happens: the blocks it demoted or
    evicted, within a round trip of the change. Returns when `stop` is set (within `wait_s`).
    `store` is a connection of its own (the feed's long poll holds it); a batch the feed lost
    (the sidecar restarted, or this fell behind) is an audit of every remembered block."""
    cursor = (0, 0)
    while not stop.is_set():
        batch = store.changes(cursor, wait_s=wait_s)
        cursor = batch.cursor
        if batch.lost or batch.keys:
            announcer.audit(lambda keys: store.lookup(keys).tiers.tolist(), None if batch.lost else batch.keys)


def _parents_first(blocks: dict[int, _Block]) -> list[int]:
    """The hashes of `blocks`, each after its parent when the parent is among them too: llm-d
    resolves an event's parent when it reads the event, and may have forgotten a parent that
    was removed everywhere until the parent is stored again."""
    order: list[int] = []
    done: set[int] = set()
    for first in blocks:
        chain = []
        h: int | None = first
        while h is not None and h in blocks and h not in done:
            chain.append(h)
            done.add(h)
            h = blocks[h].parent
        order.extend(reversed(chain))
    return order
