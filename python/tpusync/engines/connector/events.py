"""KV events for the blocks tpusync holds for a vLLM engine, on vLLM's own event publisher.

vLLM publishes its GPU cache (medium "GPU") through the publisher `--kv-events-config`
configures. Blocks in the pod's sidecar (host DRAM, disk) are the connector's to announce: the
scheduler collects them with `KVConnectorBase_V1.take_events()` after every step and publishes
them in the same batch as its own, on the same ZMQ socket and topic (vLLM 0.32.0:
`Scheduler.update_from_output`, "collect KV cache events from connector"; vLLM's
OffloadingConnector announces its CPU tier the same way).

What to announce is `tpusync.kv.events.BlockAnnouncer`'s job, the same one the reference
server uses: after a request finishes, the prompt's full blocks the sidecar holds, from the
first one, per tier ("CPU" for host DRAM, "DISK"); what the sidecar demotes or evicts, as its
change feed reports it, and the shared tier's blocks any host stored (`tpusync.kv.events.follow`);
every `kv_events_audit_s` seconds, an audit of them all as a backstop. This module only turns its
positional events into vLLM's `BlockStored` / `BlockRemoved` and queues them until the
scheduler takes them.

vLLM publishes only when its engine steps: what the feed or an audit finds while the engine is
idle goes out with its next step (vLLM's engine loop sleeps on its input queue until a request
comes). With `kv_events_endpoint` the connector publishes every event the moment it has it,
between vLLM's own on the router's endpoint (`tpusync.engines.connector.relay`); after vLLM clears its
prefix cache, it announces again what the store holds.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from tpusync import errors
from tpusync.engines.connector.common import log
from tpusync.engines.connector.link import StoreLink
from tpusync.engines.connector.relay import relay_for
from tpusync.kv.events import BlockAnnouncer, Event, as_structs, event_hash, follow, tiers_of

if TYPE_CHECKING:
    from vllm.config import KVEventsConfig

    from tpusync.engines.connector.config import ConnectorConfig

def to_vllm(event: Event) -> KVCacheEvent:
    """One of BlockAnnouncer's positional events as vLLM's event struct."""
    converted: KVCacheEvent = as_structs(event, functools.partial(BlockStored, lora_name=None), BlockRemoved)
    return converted


class ConnectorEvents:
    """The scheduler half's KV events: announcements after requests, the store's change feed
    and the store audit on threads (and store connections) of their own, and the queue
    `take()` drains, or the relay (`cfg.kv_events_endpoint`). Thread-safe."""

    def __init__(self, cfg: ConnectorConfig, *, block_size: int, block_bytes: int,
                 vllm_events: KVEventsConfig | None = None, dp_rank: int = 0) -> None:
        self._wake = threading.Event()  # an audit now, not at the end of its period
        self._cleared = threading.Event()  # ... after vLLM's AllBlocksCleared
        self._relay = None
        if cfg.kv_events_endpoint is not None:
            if vllm_events is None:
                raise errors.InvalidArgumentError("kv_events_endpoint needs vLLM's --kv-events-config")
            self._relay = relay_for(cfg.kv_events_endpoint, vllm_events, dp_rank, self._on_cleared)
        self._pending: list[KVCacheEvent] = []
        self._lock = threading.Lock()
        self.announcer = BlockAnnouncer(self, block_size)
        self._audit_link = StoreLink(cfg, block_bytes, "KV event audits")
        self._feed_link = StoreLink(cfg, block_bytes, "the KV events feed")
        self._retry_s = max(cfg.retry_s, 0.5)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._feed_loop, daemon=True, name="tpusync-kv-events-feed")]
        if cfg.kv_events_audit_s > 0 or self._relay is not None:
            period = cfg.kv_events_audit_s or None  # None: only after a clear
            self._threads.append(threading.Thread(target=self._audit_loop, args=(period,), daemon=True,
                                                  name="tpusync-kv-events-audit"))
        self._started = False

    def send(self, events: list[Event]) -> None:
        """BlockAnnouncer's sink: published now by the relay, or queued for the scheduler's next
        take_events()."""
        converted = [to_vllm(e) for e in events]
        if self._relay is not None:
            self._relay.send(converted)
            return
        with self._lock:
            self._pending.extend(converted)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last take (the scheduler's, after every step)."""
        with self._lock:
            out, self._pending = self._pending, []
            start, self._started = not self._started, True
        if start:  # at the first step: by then the connector has set its links (tpu_inference.shards)
            for t in self._threads:
                t.start()
        return out

    def sharded(self, audit_link: StoreLink, feed_link: StoreLink) -> None:
        """For blocks stored as shards: the audit and the feed through links that see the store
        by block (tpu_inference.shards), and no shared-tier records (a shard's record would
        name no block). Before the first take()."""
        self._audit_link, self._feed_link = audit_link, feed_link
        self.announcer.describing = False

    def announce(self, keys: list[int], tokens: list[int], tiers: list[int], held: int) -> None:
        """A request's prompt blocks (store keys, their tokens) and where the store holds them."""
        self.announcer.announce([event_hash(k) for k in keys], keys, tokens, tiers, held)

    def _feed_loop(self) -> None:
        while not self._stop.is_set():
            store = self._feed_link.get()
            if store is None:
                self._stop.wait(self._retry_s)  # the link is down that long: a back-off
                continue
            try:
                follow(self.announcer, store, self._stop)
            except errors.TpuSyncError as e:  # the sidecar is away; reconnecting, a lost batch audits all
                self._feed_link.failed(e)
            except Exception as e:  # noqa: BLE001 - never let the feed thread die
                log.exception("tpusync KV events feed failed")
                self._feed_link.failed(e)

    def _on_cleared(self) -> None:
        """The relay forwarded vLLM's AllBlocksCleared (on its thread: no lock taken here)."""
        self._cleared.set()
        self._wake.set()

    def _audit_loop(self, every_s: float | None) -> None:
        while True:
            # A period, or a clear to repair (retried while the store is away); nothing waits on it.
            self._wake.wait(self._retry_s if self._cleared.is_set() else every_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            store = self._audit_link.get()
            if store is None:
                continue
            repair = self._cleared.is_set()
            if repair:
                self._cleared.clear()
                self.announcer.cleared()
            try:
                self.announcer.audit(tiers_of(store))
            except errors.TpuSyncError as e:  # the sidecar is away: try again next period
                self._audit_link.failed(e)
                if repair:
                    self._cleared.set()
            except Exception:  # noqa: BLE001 - never let the audit thread die
                log.exception("tpusync KV event audit failed")

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5)
        self._audit_link.close()
        self._feed_link.close()
        if self._relay is not None:
            self._relay.stop()
