"""KV events for llm-d's precise prefix-cache routing, in vLLM's wire format.

Each message is three ZMQ frames: the topic, a sequence number (uint64 big-endian), and a
msgpack payload `[timestamp, [event, ...], data_parallel_rank]`. Events are positional
arrays tagged by name:
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
  ["BlockRemoved", block_hashes, medium]
  ["AllBlocksCleared"]
Block hashes are the 64-bit forms of tpusync's block keys (tpusync.kv.keys.event_hash_of): to
llm-d (v0.9.0) they are opaque engine keys, mapped to the keys it computes itself from each
event's token ids (docs/block-keys.md). `medium` says which tier holds the block: "CPU" for
host DRAM, "DISK" for the disk tier, "SHARED_STORAGE" for the shared tier (vLLM's and
upstream TPU Sync's name for it); llm-d keeps it, lower-cased, as the block's tier.

Every engine that mounts a shared tier announces what the tier holds, whoever stored it: the
engine that stores a block writes a record beside it on the tier (its parent and tokens,
`encode_record`), and each engine's `follow` learns from its store's change feed which blocks
other hosts published or removed, reads their records and announces them under its own topic
(llm-d v0.9.0 credits a block only to the pod whose stream announced it).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from array import array
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from tpusync import errors

if TYPE_CHECKING:
    from tpusync.store import Changes, KVStore

log = logging.getLogger(__name__)

Event = list[Any]  # one positional event, as above


def block_stored(block_hashes: Sequence[int], parent_hash: int | None, token_ids: Sequence[int], block_size: int,
                 *, medium: str = "CPU", lora_id: int | None = None) -> Event:
    return ["BlockStored", list(block_hashes), parent_hash, list(token_ids), block_size, lora_id, medium]


def block_removed(block_hashes: Sequence[int], *, medium: str = "CPU") -> Event:
    return ["BlockRemoved", list(block_hashes), medium]


def as_structs(event: Event, stored: Callable[..., Any], removed: Callable[..., Any]) -> Any:
    """One positional event as an engine's event struct (vLLM's or SGLang's `BlockStored` and
    `BlockRemoved`, which take the same field names)."""
    if event[0] == "BlockStored":
        _, hashes, parent, tokens, block_size, lora_id, medium = event
        return stored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                      lora_id=lora_id, medium=medium)
    if event[0] == "BlockRemoved":
        _, hashes, medium = event
        return removed(block_hashes=hashes, medium=medium)
    raise errors.InvalidArgumentError(f"unknown KV event {event[0]!r}")


class EventSink(Protocol):
    """Where a BlockAnnouncer sends its batches: a KVEventPublisher, or an engine's own publisher
    through an adapter (tpusync.engines.connector.events). `send` returns the batch's sequence number if known."""

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
_SHARED = 4
_MEDIA_BITS = (("CPU", 1), ("DISK", 2), ("SHARED_STORAGE", _SHARED))
_EVERY = frozenset(m for m, _ in _MEDIA_BITS)


def event_hash(key: int) -> int:
    """The engine key llm-d reads for a store key: its low 64 bits (docs/block-keys.md)."""
    return key & ((1 << 64) - 1)


def _media(tier: int) -> frozenset[str]:
    return frozenset(m for m, bit in _MEDIA_BITS if int(tier) & bit)


def block_tier(parts: Sequence[int]) -> int:
    """The tier of a block stored in parts (each a Tier code): the tiers that hold every part;
    when every part is held but on different tiers, the slowest tier a part is on (a load waits
    for it). 0 when a part is missing."""
    common, seen = -1, 0
    for part in parts:
        t = int(part)
        if not t:
            return 0
        common &= t
        seen |= t
    return common if common else 1 << (seen.bit_length() - 1)


# A block's record on the shared tier: version, flags (1: has a parent, 2: has a LoRA id), the
# parent's event hash, the LoRA id, then the token ids (uint32, little-endian).
_RECORD = struct.Struct("<BBxxQq")
_RECORD_VERSION = 1


def encode_record(parent: int | None, tokens: Sequence[int], lora_id: int | None = None) -> bytes:
    """What another host needs to announce a block it did not compute: its parent and tokens."""
    flags = (1 if parent is not None else 0) | (2 if lora_id is not None else 0)
    return _RECORD.pack(_RECORD_VERSION, flags, parent or 0, lora_id or 0) + array("I", tokens).tobytes()


def decode_record(record: bytes) -> tuple[int | None, array[int], int | None] | None:
    """(parent, tokens, lora_id) of a record, None if it is not one this version reads."""
    if len(record) <= _RECORD.size or (len(record) - _RECORD.size) % 4:
        return None
    version, flags, parent, lora = _RECORD.unpack_from(record)
    if version != _RECORD_VERSION:
        return None
    tokens = array("I")
    tokens.frombytes(record[_RECORD.size:])
    return (parent if flags & 1 else None), tokens, (lora if flags & 2 else None)


@dataclass
class _Block:
    keys: tuple[int, ...]     # the store keys of its parts (one for a block stored whole)
    parent: int | None        # the event hash of the block before it
    tokens: array[int]        # its token ids, to announce it again on another tier (none: tokenless)
    media: frozenset[str]     # where llm-d was last told it is
    described: bool = False   # its record is on the shared tier (or was queued to be written)


class BlockAnnouncer:
    """Keeps llm-d's index of one engine's blocks true to what its store holds. Thread-safe.

    The one implementation of "what to announce" for every engine tpusync serves: the reference
    server (`tpusync.serving`) sends its batches to a KVEventPublisher, vLLM's and tpu-inference's
    connector to vLLM's own publisher (`tpusync.engines.connector.events`).

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
        self._records: dict[int, bytes] = {}  # store key -> record, to write beside the block
        self.describing = True                # until the store turns out to have no shared tier
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
                old = self._blocks.pop(h, None)
                b = self.block_size
                block = _Block((keys[i],), hashes[i - 1] if i else None, array("I", tokens[i * b:(i + 1) * b]),
                               media[i], described=old is not None and old.described)
                if i < held and not block.described and self.describing and len(self._records) < self.remember:
                    self._records[keys[i]] = encode_record(block.parent, block.tokens)
                    block.described = True
                self._blocks[h] = block
                self._by_key[keys[i]] = h
            self._trim()
            # Sent under the lock: batches leave in the order the announcer's state changed.
            return self.publisher.send(batch) if batch else None

    def cleared(self) -> None:
        """The index forgot every block of this engine (the engine's AllBlocksCleared): the next
        audit announces each remembered block again, wherever the store still holds it."""
        with self._lock:
            for b in self._blocks.values():
                b.media = frozenset()

    def take_records(self) -> dict[int, bytes]:
        """The records of the blocks announced since the last take, for `KVStore.describe`."""
        with self._lock:
            out, self._records = self._records, {}
            return out

    def unknown(self, keys: Collection[int]) -> list[int]:
        """The store keys among `keys` of blocks this announcer does not remember."""
        with self._lock:
            return [k for k in dict.fromkeys(keys) if k not in self._by_key]

    def adopt(self, records: Mapping[int, bytes]) -> list[int]:
        """Remembers blocks that another engine stored, from their shared-tier records (store key
        -> record); the next audit of their keys announces them where the store finds them.
        Returns the keys adopted (an empty or unreadable record adopts nothing)."""
        adopted = []
        with self._lock:
            for key, record in records.items():
                decoded = decode_record(record) if record else None
                if key in self._by_key or decoded is None or len(decoded[1]) != self.block_size:
                    continue
                parent, tokens, _ = decoded
                h = event_hash(key)
                self._blocks[h] = _Block((key,), parent, tokens, frozenset(), described=True)
                self._by_key[key] = h
                adopted.append(key)
            self._trim()
        return adopted

    def track(self, hashes: Sequence[int], parts: Sequence[Sequence[int]],
              lookup: Callable[[list[int]], Sequence[int]]) -> int | None:
        """Announces blocks an engine announces with tokens itself (SGLang's pages, on its own
        stream), where the store holds every one of their parts (`parts`: per block, its store
        keys), as tokenless events: llm-d adds the tier to the engine keys it has mapped from the
        engine's own events. Their parts' changes are followed as any block's. Returns the
        batch's sequence number (None: nothing to say)."""
        with self._lock:
            for h, keys in zip(hashes, parts):
                old = self._blocks.pop(h, None)
                block = old if old is not None and old.keys == tuple(keys) else _Block(tuple(keys), None, array("I"),
                                                                                        frozenset(), described=True)
                self._blocks[h] = block
                for k in block.keys:
                    self._by_key[k] = h
            self._trim()
        return self.audit(lookup, [k for keys in parts for k in keys])

    def _trim(self) -> None:
        """Forgets the least recently served blocks past `remember` (under the lock)."""
        while len(self._blocks) > self.remember:
            h, block = next(iter(self._blocks.items()))
            del self._blocks[h]
            for k in block.keys:
                if self._by_key.get(k) == h:
                    del self._by_key[k]

    def audit(self, lookup: Callable[[list[int]], Sequence[int]],
              keys: Collection[int] | None = None) -> int | None:
        """Asks the store where the remembered blocks are (`lookup(keys)` -> Tier codes per key,
        every key answered: `tiers_of`) and announces what changed since; returns the batch's
        sequence number, None if nothing did.
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
        flat = lookup([k for _, b in items for k in b.keys])
        tiers, at = [], 0
        for _, b in items:
            tiers.append(block_tier(flat[at:at + len(b.keys)]))
            at += len(b.keys)
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


def follow(announcer: BlockAnnouncer, store: KVStore, stop: threading.Event, *, wait_s: float = 0.25,
           catalog: int = 4096, record_wait_s: float = 60.0) -> None:
    """Announces what the store's change feed reports as it happens: the blocks it demoted or
    evicted, within a round trip of the change. Returns when `stop` is set (within `wait_s`).
    `store` is a connection of its own (the feed's long poll holds it); a batch the feed lost
    (the sidecar restarted, or this fell behind) is an audit of every remembered block.

    With a shared tier it also writes the records of the blocks this engine announced, and
    announces the blocks other hosts stored there as the store's scans find them (and, when
    the feed was lost, the `catalog` most recently read). Records are written at the next wake
    after the announcement, at most `wait_s` later; a block found without its record (its
    engine writes it after storing the block) is asked for again at each wake, for up to
    `record_wait_s`."""
    cursor = (0, 0)
    awaiting: dict[int, float] = {}  # blocks found on the tier without a record yet -> until when
    tiers = tiers_of(store)
    while not stop.is_set():
        batch = store.changes(cursor, wait_s=wait_s)
        cursor = batch.cursor
        adopted = _shared_blocks(announcer, store, batch, awaiting, catalog, record_wait_s)
        if batch.lost or batch.keys or adopted:
            announcer.audit(tiers, None if batch.lost else [*batch.keys, *adopted])


def tiers_of(store: KVStore) -> Callable[[list[int]], Sequence[int]]:
    """An audit's lookup: where the store holds each key now (`KVStore.where`)."""
    return lambda keys: store.where(keys).tolist()


def _shared_blocks(announcer: BlockAnnouncer, store: KVStore, batch: Changes, awaiting: dict[int, float],
                   catalog: int, record_wait_s: float) -> list[int]:
    """One wake of `follow` on the shared tier: the records of this engine's blocks written,
    and the blocks only the tier holds (another host stored them) adopted from their records.
    Returns the keys adopted."""
    if not announcer.describing:
        return []
    try:
        if records := announcer.take_records():
            try:
                store.describe(list(records), list(records.values()))
            except errors.PreconditionError:
                raise
            except errors.TpuSyncError as e:  # a record is a help to other hosts, never a request's failure
                log.warning("could not write %d block records on the shared tier: %s", len(records), e)
        if batch.lost:
            found = store.records(max_keys=catalog)
        else:
            now = time.monotonic()
            for k in [k for k, until in awaiting.items() if until < now]:
                del awaiting[k]
            ask = announcer.unknown([*batch.keys, *awaiting])
            # Only blocks held on the tier alone: this engine's own puts are never asked about.
            ask = [k for k, tier in zip(ask, store.where(ask).tolist()) if tier == _SHARED] if ask else []
            found = store.records(ask) if ask else {}
    except errors.PreconditionError:  # no shared tier behind this store
        announcer.describing = False
        announcer.take_records()
        return []
    adopted = announcer.adopt(found)
    for k in adopted:
        awaiting.pop(k, None)
    deadline = time.monotonic() + record_wait_s
    for k, record in found.items():
        if not record and k not in awaiting and len(awaiting) < catalog:
            awaiting[k] = deadline
    return adopted


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
