"""KV events for the HiCache pages tpusync stores for SGLang, on the pod's one KV-events endpoint.

SGLang 0.5.23 announces its device and host caches (mediums "GPU" and "CPU_PINNED") but nothing
for L3, whichever backend (docs/sglang.md). This module announces what the pod's sidecar holds
for the engine, in SGLang's own wire format (`sglang.srt.disaggregation.kv_events`: its
`KVEventBatch`, `BlockStored`, `BlockRemoved`, encoded by msgspec as its `ZmqEventPublisher`
does), relayed with SGLang's own events on one endpoint (`tpusync.kv.relay`):

- A page's event hash is SGLang's: `hash_str_to_int64` of the page's storage key, the hash
  SGLang's own `BlockStored` carries for a prompt without a LoRA or cache salt
  (sglang/srt/mem_cache/events.py, `record_store`).
- The events carry no tokens: llm-d (v0.9.0, pkg/kvevents/pool.go `handleDeviceTierUpdate`)
  adds the tier to engine keys it has mapped from SGLang's own events, which carry them.
- A page is announced once every part of it is in the store: every TP rank's heads (the ranks
  of one host share its sidecar) or MLA's one latent. One scheduler publishes per data-parallel
  rank, as SGLang's own (`is_kv_publisher_rank`: TP, PP and CP rank 0), on the endpoint offset
  by that rank as SGLang offsets its own.
- Demotions and evictions by the sidecar reach the router from its change feed, within a round
  trip; an `AllBlocksCleared` of SGLang's (`/flush_cache`) makes llm-d forget the pod, so every
  page the store still holds is announced again.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from sglang.srt.mem_cache.utils import hash_str_to_int64

from tpusync import errors
from tpusync.engines.sglang.keys import KeyScope, block_keys
from tpusync.kv.events import BlockAnnouncer, Event, as_structs, follow, tiers_of
from tpusync.kv.relay import EventRelay, reachable
from tpusync.store import KVStore

SETTING = "kv_events"
_FIELDS = {"endpoint", "engine_endpoint", "topic"}
_CLEARED_TAG = AllBlocksCleared.__name__.encode()


@dataclasses.dataclass(frozen=True)
class EventsConfig:
    """The `kv_events` object of the backend's extra config."""

    endpoint: str         # the pod's endpoint, where llm-d subscribes (bound here)
    engine_endpoint: str  # SGLang's own publisher (--kv-events-config endpoint), which must bind
    topic: str            # kv@<pod address>@<model>, as SGLang's --kv-events-config topic

    @classmethod
    def parse(cls, raw: Any) -> EventsConfig:
        if not isinstance(raw, dict):
            raise errors.InvalidArgumentError(f"{SETTING} must be an object with {sorted(_FIELDS)}, not {raw!r}")
        if unknown := set(raw) - _FIELDS:
            raise errors.InvalidArgumentError(f"{SETTING}: unknown fields {sorted(unknown)}; "
                                              f"it takes {sorted(_FIELDS)}")
        missing = [f for f in sorted(_FIELDS) if not isinstance(raw.get(f), str) or not raw[f]]
        if missing:
            raise errors.InvalidArgumentError(f"{SETTING}: {', '.join(missing)} must be set (strings)")
        if not raw["topic"].startswith("kv@"):
            raise errors.InvalidArgumentError(f"{SETTING}.topic {raw['topic']!r}: llm-d reads kv@<pod>@<model>")
        return cls(raw["endpoint"], raw["engine_endpoint"], raw["topic"])


def publishes(config: Any) -> bool:
    """Whether this rank's backend publishes (SGLang's own publisher ranks: TP, PP and CP rank 0)."""
    return int(config.tp_rank) == 0 and int(config.pp_rank) == 0 and int(getattr(config, "attn_cp_rank", 0) or 0) == 0


def page_hash(key: str) -> int:
    """SGLang's event hash of a page, from its storage key (SGLang's own conversion)."""
    return int(hash_str_to_int64(key))


def part_keys(scope: KeyScope, pages: Sequence[str], slots: Sequence[str]) -> list[list[int]]:
    """Per page, the store keys of all its parts: every TP rank's slots (MHA), or the one latent's (MLA)."""
    ranks = [scope] if scope.mla else [dataclasses.replace(scope, tp_rank=r) for r in range(scope.tp_size)]
    per_rank = [block_keys(s.namespace(), pages, slots) for s in ranks]
    n = len(slots)
    return [[int.from_bytes(k, "big") for keys in per_rank for k in keys[i * n:(i + 1) * n]]
            for i in range(len(pages))]


class StorageEvents:
    """The publishing rank's events: the relay, the announcer and the store's change feed
    (on a connection of its own, `open_store`). Thread-safe."""

    def __init__(self, cfg: EventsConfig, *, dp_rank: int, pp_size: int, open_store: Callable[[], KVStore],
                 retry_s: float = 1.0) -> None:
        if pp_size != 1:
            raise errors.InvalidArgumentError(
                f"{SETTING} needs one pipeline stage (pp_size {pp_size}): a page's parts on the other stages "
                "are in other stores, so no rank can tell when the page is whole")
        offset = ZmqEventPublisher.offset_endpoint_port  # as SGLang offsets its own publisher's
        self._relay = EventRelay(offset(cfg.endpoint, dp_rank) or cfg.endpoint,
                                 reachable(offset(cfg.engine_endpoint, dp_rank) or "",
                                           setting=f"{SETTING}.engine_endpoint"),
                                 topic=cfg.topic, on_forwarded=self._forwarded)
        self.endpoint = self._relay.endpoint
        self._dp_rank, self._open_store, self._retry_s = dp_rank, open_store, retry_s
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KVEventBatch)
        self.announcer = BlockAnnouncer(self, 0)  # the page size arrives with the host pool
        self.announcer.describing = False  # pages are SGLang's to describe: no shared-tier records
        self._stop, self._wake = threading.Event(), threading.Event()
        self._cleared = False
        self._thread = threading.Thread(target=self._feed_loop, daemon=True, name="tpusync-sglang-kv-events")
        self._thread.start()

    def set_page_size(self, page_size: int) -> None:
        self.announcer.block_size = page_size

    def stored(self, store: KVStore, pages: Sequence[str], parts: Sequence[Sequence[int]]) -> None:
        """Pages this rank stored or pulled: announced where the store holds all their parts."""
        self.announcer.track([page_hash(p) for p in pages], parts, tiers_of(store))

    def send(self, events: list[Event]) -> None:
        """BlockAnnouncer's sink: the events in SGLang's structs, published now."""
        batch = KVEventBatch(ts=time.time(), events=[as_structs(e, BlockStored, BlockRemoved) for e in events],
                             attn_dp_rank=self._dp_rank)
        self._relay.publish(self._encoder.encode(batch))

    def _forwarded(self, payload: bytes) -> None:
        """A batch of SGLang's went out (the relay's thread): after an AllBlocksCleared, announce again."""
        if _CLEARED_TAG not in payload:
            return
        try:
            cleared = any(isinstance(e, AllBlocksCleared) for e in self._decoder.decode(payload).events)
        except msgspec.DecodeError:
            return
        if cleared:
            self._cleared = True
            self._wake.set()

    def _feed_loop(self) -> None:
        while not self._stop.is_set():
            try:
                store = self._open_store()
            except Exception:  # noqa: BLE001 - the sidecar is away: dial again shortly
                self._stop.wait(self._retry_s)
                continue
            try:
                while not self._stop.is_set():
                    follow(self.announcer, store, self._wake)  # returns on a clear, or to stop
                    self._wake.clear()
                    if self._cleared:
                        self._cleared = False
                        self.announcer.cleared()
                        self.announcer.audit(tiers_of(store))
            except Exception:  # noqa: BLE001 - a lost sidecar; a new feed audits every page it tracks
                self._stop.wait(self._retry_s)
            finally:
                store.close()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._relay.stop()
