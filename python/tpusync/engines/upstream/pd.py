"""The transfer mode of upstream's KVCacheManager (max_blocks, num_slots): prefill/decode pulls
between engines, on the engines' tpusync sidecars.

Upstream's producer registers a request's blocks under a random uuid (`register_read`), the
consumer pulls them into its own blocks (`start_read`) and both learn the outcome from
`poll_stats` (google/tpu-sync kv_cache_manager_with_transfer.cc: NotifyForRead, StartRead,
CompleteRead). Here:
- `register_read` copies the blocks' pages into the producer's sidecar pool under keys of
  (uuid, block id), pinned on this manager's connection until the consumer acknowledges them
  or `timeout_s` passes; either way `poll_stats` then reports the request in done_sending and
  the copies are let go;
- `start_read` pulls those keys from the producer's sidecar into the consumer's, on a thread
  of its own (waiting while the producer has not registered them yet, as upstream's pull
  waits), then acknowledges by pushing a small ack block to the producer's sidecar; the pages
  go into the runner's cache in `poll_stats`, on the runner's thread, before the request is
  reported in done_recving. A pull that fails or passes `timeout_s` is reported in
  failed_recving.
The endpoint the consumer dials ("host:port", from the producer's TPU_KV_TRANSFER_PORT) is the
producer pod's sidecar data port: sessions there are authenticated with the pool's secret.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpusync import errors
from tpusync.engines.upstream.counters import count
from tpusync.kv import pages
from tpusync.kv.keys import key_of
from tpusync.store import KVStore

log = logging.getLogger("tpusync.upstream")
_POLL_S = 0.005  # how often a pull that came before its registration looks again


def block_key(uuid: int, block_id: int) -> int:
    """The pool key of block `block_id` registered under `uuid`."""
    return key_of(hashlib.blake2b(f"tpusync.engines.upstream.pd/{uuid}/{block_id}".encode(), digest_size=32).digest())


def ack_key(uuid: int) -> int:
    return key_of(hashlib.blake2b(f"tpusync.engines.upstream.pd/{uuid}/ack".encode(), digest_size=32).digest())


@dataclass
class _Send:
    req_id: str
    keys: list[int]     # the pool keys pinned for it (every local shard of every block)
    deadline: float


@dataclass
class _Pull:
    req_id: str
    uuid: int
    peer: str
    remote: list[int]
    local: list[int]
    deadline: float
    error: str | None = None


class Transfers:
    def __init__(self, runner: Any, store: KVStore, connect: Callable[[], KVStore], *, max_blocks: int,
                 num_slots: int, timeout_s: float) -> None:
        self._runner = runner
        self._store = store          # the runner thread's connection: pins, saves, loads
        self._connect = connect      # a connection for each pull thread
        self._max_blocks, self._timeout = max_blocks, timeout_s
        self._lock = threading.Lock()
        self._sends: dict[int, _Send] = {}           # uuid -> registered send
        self._pulls = ThreadPoolExecutor(num_slots, thread_name_prefix="tpusync-upstream-pull")
        self._slots = threading.BoundedSemaphore(num_slots)
        self._pulled: list[_Pull] = []                # finished pulls, for poll_stats
        self._done_sending: list[str] = []

    # -- producer ------------------------------------------------------------------------------

    def register_read(self, req_id: str, uuid: int, block_ids: Sequence[int]) -> bool:
        if not block_ids:
            return False
        keys = [block_key(uuid, b) for b in block_ids]
        pages.save_pages(self._store, keys, self._runner.kv_caches, list(block_ids))
        stored = pages.shard_keys(keys, self._runner.kv_caches)
        self._store.pin(stored)
        with self._lock:
            self._sends[uuid] = _Send(req_id, stored, time.monotonic() + self._timeout)
        count(registered_blocks=len(keys))
        return True

    def _sent(self) -> None:
        """Moves acknowledged and expired sends to done_sending, letting their copies go."""
        with self._lock:
            sends = dict(self._sends)
        if not sends:
            return
        acked = self._store.lookup([ack_key(u) for u in sends]).tiers
        now = time.monotonic()
        for (uuid, send), tier in zip(sends.items(), acked):
            if not tier and now < send.deadline:
                continue
            if not tier:
                log.warning("request %s: not pulled within %.0f s; its blocks are let go", send.req_id,
                            self._timeout)
            with contextlib.suppress(errors.TpuSyncError):  # a restarted sidecar dropped the pins already
                self._store.release(send.keys)
            with contextlib.suppress(errors.TpuSyncError):
                self._store.evict(send.keys + ([ack_key(uuid)] if tier else []))
            with self._lock:
                del self._sends[uuid]
                self._done_sending.append(send.req_id)
            count(**{"acked_sends" if tier else "expired_sends": 1})

    # -- consumer ------------------------------------------------------------------------------

    def start_read(self, req_id: str, uuid: int, remote_endpoint: str | list[dict[str, Any]],
                   remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> None:
        if isinstance(remote_endpoint, list):
            if not remote_endpoint:
                return  # upstream: no descriptors, nothing to pull
            peer = str(remote_endpoint[0]["endpoint"])  # one sidecar serves every shard of the host
        elif isinstance(remote_endpoint, str):
            peer = remote_endpoint
        else:
            raise RuntimeError("remote_endpoint must be str or list of dicts")
        pull = _Pull(req_id, int(uuid), peer, [int(b) for b in remote_block_ids], [int(b) for b in local_block_ids],
                     time.monotonic() + self._timeout)
        if not pull.remote:
            self._finish(pull)  # nothing to move: done at once
            return
        if len(pull.remote) != len(pull.local):
            pull.error = f"{len(pull.remote)} remote blocks for {len(pull.local)} local blocks"
        elif len(set(pull.local)) > self._max_blocks:
            pull.error = f"{len(set(pull.local))} blocks exceed max_blocks={self._max_blocks}"
        elif not self._slots.acquire(blocking=False):
            pull.error = "no free slot (num_slots pulls are running)"
        if pull.error is not None:
            self._finish(pull)
            return
        self._pulls.submit(self._pull, pull)

    def _pull(self, pull: _Pull) -> None:
        """Pulls the blocks into this host's sidecar and acknowledges them (a pull thread)."""
        try:
            keys = [block_key(pull.uuid, b) for b in pull.remote]
            wanted = pages.shard_keys(keys, self._runner.kv_caches)
            with self._connect() as store:
                while not all(store.read_remote(pull.peer, wanted)):
                    if time.monotonic() >= pull.deadline:
                        raise errors.DeadlineExceededError(f"the blocks were not at {pull.peer} within "
                                                           f"{self._timeout:.0f} s")
                    time.sleep(_POLL_S)  # the producer has not registered them yet
                ack = ack_key(pull.uuid)
                store.put([ack], [np.zeros(1, np.uint8)])
                store.push_remote(pull.peer, [ack])
                with contextlib.suppress(errors.TpuSyncError):
                    store.evict([ack])
        except Exception as e:  # noqa: BLE001 - reported in failed_recving
            pull.error = f"{type(e).__name__}: {e}"
        finally:
            self._slots.release()
            self._finish(pull)

    def _finish(self, pull: _Pull) -> None:
        with self._lock:
            self._pulled.append(pull)

    # -- both ----------------------------------------------------------------------------------

    def poll_stats(self) -> tuple[list[str], list[str], list[str]]:
        """(done_sending, done_recving, failed_recving) since the last call; lands pulled pages
        in the runner's cache first (this runs on the runner's thread)."""
        self._sent()
        with self._lock:
            pulled, self._pulled = self._pulled, []
            done_sending, self._done_sending = self._done_sending, []
        done_recving, failed = [], []
        for pull in pulled:
            if pull.error is None and pull.remote:
                pull.error = self._land(pull)
            if pull.error is None:
                count(pulled_blocks=len(pull.remote))
                done_recving.append(pull.req_id)
            else:
                count(failed_pulls=1)
                log.error("request %s: pull from %s failed: %s", pull.req_id, pull.peer, pull.error)
                failed.append(pull.req_id)
        return done_sending, done_recving, failed

    def _land(self, pull: _Pull) -> str | None:
        keys = [block_key(pull.uuid, b) for b in pull.remote]
        try:
            self._runner.kv_caches, loaded = pages.load_pages(self._store, keys, self._runner.kv_caches, pull.local)
        except (errors.TpuSyncError, OSError) as e:
            return f"loading the pulled blocks: {e}"
        finally:
            with contextlib.suppress(errors.TpuSyncError):
                self._store.evict(pages.shard_keys(keys, self._runner.kv_caches))
        return None if loaded == len(keys) else f"{len(keys) - loaded} pulled blocks left the pool before loading"

    def close(self) -> None:
        self._pulls.shutdown(wait=True)
