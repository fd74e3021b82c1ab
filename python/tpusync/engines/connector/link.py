"""TPUSyncConnector's connection to the block store, dropped on failure and reopened later, and
the pins taken through it."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from tpusync import errors
from tpusync.engines.connector.common import COUNTERS, log
from tpusync.engines.connector.config import ConnectorConfig
from tpusync.store import KVStore

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
    earlier store object are still held. `companion(store)`, when given, is a context entered
    once a store opens and exited before it closes (the worker's registration of the pool with
    CUDA); one that fails is logged and the store used without it.
    """

    def __init__(self, cfg: ConnectorConfig, block_bytes: int, purpose: str, *,
                 companion: Callable[[KVStore], AbstractContextManager[object]] | None = None) -> None:
        self._cfg, self._block_bytes, self._purpose = cfg, block_bytes, purpose
        self._companion = companion
        self._companions: dict[int, contextlib.ExitStack] = {}  # id(store) -> its companion, entered
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
            self._enter_companion(store)
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

    def _enter_companion(self, store: KVStore) -> None:
        if self._companion is None:
            return
        stack = contextlib.ExitStack()
        try:
            got = stack.enter_context(self._companion(store))
        except (errors.TpuSyncError, OSError) as e:
            log.warning("tpusync store for %s: %s; running without it", self._purpose, e)
            return
        self._companions[id(store)] = stack
        log.info("tpusync store for %s: %s", self._purpose, "pool registered" if got else "pool not registered")

    def _open(self) -> KVStore:
        if self._cfg.store == "local":
            return _local_store(self._cfg, self._block_bytes)
        return KVStore.connect(f"unix://{self._cfg.control_socket}", timeout=self._cfg.timeout_s)

    def _close(self, store: KVStore) -> None:
        companion = self._companions.pop(id(store), None)
        if companion is not None:  # before the store: a registration of its pool would outlive the mapping
            companion.close()
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
