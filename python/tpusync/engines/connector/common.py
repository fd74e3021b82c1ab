"""What the two halves of TPUSyncConnector share: the messages between them, the connection
to the block store (dropped on failure, reopened later) and the process's counters."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger

from tpusync import errors
from tpusync.engines.connector.config import ConnectorConfig
from tpusync.kv.path_metrics import OFF_REASONS
from tpusync.store import KVStore

log = init_logger("vllm.tpusync")  # under vLLM's logging configuration, beside the engine's own lines


# -- counters ---------------------------------------------------------------------------------

class Counters:
    """Totals of what the connectors of this process did (for tests and debugging; each half's
    share also reaches vLLM's metrics through get_kv_connector_stats: its log, and on /metrics
    under the KV path's names, tpusync.engines.connector.prom), and why a connector of this
    process switched itself off."""

    FIELDS = ("requests", "handoffs", "lookups", "matched_requests", "matched_tokens", "pulled_blocks",
              "peer_errors", "store_errors", "loaded_blocks", "load_error_blocks", "saved_blocks", "save_errors",
              "refused_prefills")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.FIELDS, 0)
        self._off: set[str] = set()

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def switch_off(self, reason: str) -> None:
        """A connector of this process passes everything through from now on (reason: one of
        tpusync.kv.path_metrics.OFF_REASONS)."""
        if reason not in OFF_REASONS:
            raise ValueError(f"not a connector-off reason: {reason!r}")
        with self._lock:
            self._off.add(reason)

    def off(self) -> set[str]:
        with self._lock:
            return set(self._off)


COUNTERS = Counters()


def stats() -> dict[str, int]:
    """This process's connector totals (see Counters.FIELDS)."""
    return COUNTERS.snapshot()


class Interval:
    """One half's counts since vLLM last took them (each step), also added to the process's
    totals. Thread-safe (the scheduler half counts from its pull threads too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, int] = {}

    def count(self, **counts: int) -> None:
        COUNTERS.add(**counts)
        with self._lock:
            for name, n in counts.items():
                self._data[name] = self._data.get(name, 0) + n

    def take(self) -> TPUSyncStats | None:
        """The interval's counts, and `off:<reason>` = 1 while a connector here is off; None when all are 0."""
        with self._lock:
            out, self._data = self._data, {}
        return off_stats(out)


def off_stats(data: dict[str, int] | None = None) -> TPUSyncStats | None:
    out = dict(data or {}) | {f"{OFF_KEY}{reason}": 1 for reason in sorted(COUNTERS.off())}
    return TPUSyncStats(data=out) if any(out.values()) else None


OFF_KEY = "off:"  # a stats entry off:<reason> = 1: the connector switched itself off for that reason


@dataclass
class TPUSyncStats(KVConnectorStats):
    """Per-interval worker counters for vLLM's KV transfer metrics log."""

    def reset(self) -> None:
        self.data: dict[str, int] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, n in other.data.items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# -- messages between the halves ----------------------------------------------------------------

@dataclass
class Transfer:
    """Blocks of one request: store keys and the vLLM block ids they go to or come from."""

    req_id: str
    keys: list[int]
    block_ids: list[int]
    shards: int = 0   # the parts each block was stored in, when another engine split it otherwise; 0: as here
    # Blocks of another engine's page size: the tokens each holds (0: a block per page, as
    # here), and the tokens of keys[0] before the first page's.
    src_tokens: int = 0
    first_token: int = 0

    def key_index(self, page: int, page_tokens: int) -> int:
        """The index in keys of the block that holds the first token of page `page`."""
        return (self.first_token + page * page_tokens) // self.src_tokens if self.src_tokens else page


@dataclass
class Probe:
    """Scheduler -> every host of a multi-host slice: look up (and pin) the parts of these blocks
    that this host's shards need, after pulling the missing ones from the prefill's hosts; the
    answer comes back in a later step's worker metadata (`SliceAnswer`)."""

    req_id: str
    keys: list[int]
    shards: int = 0                                 # the parts the blocks are stored in; 0: as here
    seq: int = 0                                    # the scheduler's number for it, echoed in the answer
    pull: int = 0                                   # leading keys the prefill or peers may hold
    remote: list[str | None] = field(default_factory=list)  # the prefill's hosts' data ports, in process order
    remote_hosts: list[list[int]] | None = None     # each prefill host's shard numbers, where it said
    peers: list[str] = field(default_factory=list)  # other sidecars that may hold them, split as here


@dataclass
class TPUSyncConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)    # multi-host slices only
    releases: list[str] = field(default_factory=list)    # requests whose hosts' pins go (multi-host)


@dataclass
class SliceAnswer:
    """The hosts' answer to a Probe, merged as vLLM aggregates the workers' metadata: the leading
    blocks every host that answered holds its parts of (pinned there), and which hosts answered."""

    seq: int
    blocks: int
    pulled: int
    hosts: set[int]
    of: int  # the slice's hosts

    def merge(self, other: SliceAnswer) -> None:
        """Takes in another host's answer; an answer to an older probe of the request gives way."""
        if other.seq != self.seq:
            if other.seq > self.seq:
                self.seq, self.blocks, self.pulled, self.hosts, self.of = (other.seq, other.blocks, other.pulled,
                                                                           set(other.hosts), other.of)
            return
        self.blocks, self.pulled = min(self.blocks, other.blocks), min(self.pulled, other.pulled)
        self.hosts |= other.hosts
        self.of = max(self.of, other.of)

    @property
    def complete(self) -> bool:
        return len(self.hosts) >= self.of


@dataclass
class TPUSyncWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: requests whose load ran (their pins can go), and
    per request the keys of blocks that could not be loaded (absent, or of another size)."""

    loaded: set[str] = field(default_factory=set)
    failed: dict[str, list[int]] = field(default_factory=dict)
    probed: dict[str, SliceAnswer] = field(default_factory=dict)          # multi-host slices only
    hosts: dict[int, tuple[str | None, list[int]]] = field(default_factory=dict)  # process: data port, shards

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, TPUSyncWorkerMetadata):
            self.loaded |= other.loaded
            for req_id, keys in other.failed.items():
                self.failed.setdefault(req_id, []).extend(keys)
            for req_id, answer in other.probed.items():
                if req_id in self.probed:
                    self.probed[req_id].merge(answer)
                else:
                    self.probed[req_id] = answer
            self.hosts.update(other.hosts)
        return self


# -- what a worker half reports after each step ------------------------------------------------

class WorkerResults:
    """The per-step results every worker half keeps and vLLM takes after each step: vLLM block
    ids that could not be loaded, the requests whose loads ran and the keys that failed (for the
    scheduler half), and the interval's counters."""

    def __init__(self) -> None:
        self.errors: set[int] = set()
        self.loaded: set[str] = set()
        self.failed: dict[str, list[int]] = {}
        self.probed: dict[str, SliceAnswer] = {}
        self.host_info: dict[int, tuple[str | None, list[int]]] = {}  # a multi-host slice's hosts
        self.interval = Interval()

    def _count(self, **counts: int) -> None:
        self.interval.count(**counts)

    def take_errors(self) -> set[int]:
        out, self.errors = self.errors, set()
        return out

    def take_worker_meta(self) -> TPUSyncWorkerMetadata | None:
        if not self.loaded and not self.failed and not self.probed:
            return None
        meta = TPUSyncWorkerMetadata(loaded=self.loaded, failed=self.failed, probed=self.probed,
                                     hosts=self.host_info if self.probed else {})
        self.loaded, self.failed, self.probed = set(), {}, {}
        return meta

    def take_stats(self) -> TPUSyncStats | None:
        return self.interval.take()


# -- the store -----------------------------------------------------------------------------

_LOCAL_STORES: dict[str | None, KVStore] = {}
_LOCAL_LOCK = threading.Lock()


def _local_store(cfg: ConnectorConfig, block_bytes: int) -> KVStore:
    """The in-process store of `pool_path`, shared by the scheduler and worker of this process."""
    with _LOCAL_LOCK:
        store = _LOCAL_STORES.get(cfg.pool_path)
        if store is None:
            store = KVStore.local(dram_bytes=cfg.dram_bytes, block_bytes=-(-block_bytes // 4096) * 4096,
                                  pool_path=cfg.pool_path)
            _LOCAL_STORES[cfg.pool_path] = store
        return store


class StoreLink:
    """One connection to the block store, dropped on failure and reopened after retry_s.

    Thread-safe. Pins belong to a connection: `current()` tells whether pins taken through an
    earlier store object are still held.
    """

    def __init__(self, cfg: ConnectorConfig, block_bytes: int, purpose: str) -> None:
        self._cfg, self._block_bytes, self._purpose = cfg, block_bytes, purpose
        self._store: KVStore | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()

    def get(self) -> KVStore | None:
        with self._lock:
            if self._store is not None or time.monotonic() < self._down_until:
                return self._store
            try:
                store = self._open()
            except (errors.TpuSyncError, OSError) as e:
                COUNTERS.add(store_errors=1)
                log.warning("tpusync store unavailable for %s (%s); retrying in %g s", self._purpose, e,
                            self._cfg.retry_s)
                self._down_until = time.monotonic() + self._cfg.retry_s
                return None
            if store.block_bytes < self._block_bytes:
                COUNTERS.switch_off("store-blocks-too-small")
                log.error("tpusync store blocks hold %d bytes, a vLLM block needs %d: the connector stays off "
                          "(start the sidecar with a larger --block-bytes)", store.block_bytes, self._block_bytes)
                self._close(store)
                self._down_until = math.inf
                return None
            self._store = store
            return store

    def current(self) -> KVStore | None:
        return self._store

    # Whether view() sees blocks split otherwise, and the worker loads blocks split or paged
    # otherwise (another tensor parallelism or page size).
    reshards = False

    def view(self, store: Any, shards: int) -> Any:
        """`store` seen through blocks stored in `shards` parts (0: as this link keys them)."""
        if shards:
            raise errors.InvalidArgumentError(f"this connector cannot load blocks stored in {shards} parts")
        return store

    def failed(self, exc: BaseException) -> None:
        """A call on the current store failed: run without it for retry_s."""
        COUNTERS.add(store_errors=1)
        log.warning("tpusync store call for %s failed (%s); running without it for %g s", self._purpose, exc,
                    self._cfg.retry_s)
        with self._lock:
            store, self._store = self._store, None
            self._down_until = time.monotonic() + self._cfg.retry_s
        if store is not None:
            self._close(store)

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            self._close(store)

    def _open(self) -> KVStore:
        if self._cfg.store == "local":
            return _local_store(self._cfg, self._block_bytes)
        return KVStore.connect(f"unix://{self._cfg.control_socket}", timeout=self._cfg.timeout_s)

    def _close(self, store: KVStore) -> None:
        if self._cfg.store == "local":
            return  # shared by the process's connectors
        with contextlib.suppress(Exception):
            store.close()


@dataclass
class Pins:
    store: KVStore | None = None   # the link's store that took them
    keys: list[int] = field(default_factory=list)
    shards: int = 0                # taken through StoreLink.view(store, shards)


def release_pins(link: StoreLink, pins: Pins) -> None:
    """Drops pins, unless the connection that took them is gone (and its pins with it)."""
    if not pins.keys or pins.store is None or pins.store is not link.current():
        return
    try:
        link.view(pins.store, pins.shards).release(pins.keys)
    except errors.PreconditionError:
        pass
    except errors.TpuSyncError as e:
        link.failed(e)
