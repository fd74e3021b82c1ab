"""The worker half of tpusync's connector for tpu-inference: pages move between the runner's
JAX KV cache (`runner.kv_caches`, one jax.Array per layer, the page axis first) and the pool's
shared-memory slots, through `tpusync.kv.pages`.

The runner reassigns `runner.kv_caches` every step (its model function donates the cache), so
the connector keeps the runner, not the arrays. Loads run in `start_load_kv`, which vLLM calls
before the forward because the scheduler half marks steps with loads synchronous; one jitted,
donated update puts the pages of every layer in place. Saves run in `wait_for_save`, after the
forward that computed the blocks.

On a multi-host slice every host's worker runs this on its own shards, through its own pod's
sidecar, and answers the scheduler's probes (`SliceHost`) from a thread of its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from tpusync import errors
from tpusync.engines.connector.common import Interval, log
from tpusync.engines.connector.config import ConnectorConfig
from tpusync.engines.connector.link import Pins, StoreLink, release_pins
from tpusync.engines.connector.messages import (
    Probe,
    SliceAnswer,
    TPUSyncConnectorMetadata,
    TPUSyncWorkerMetadata,
    WorkerResults,
)
from tpusync.kv import pages
from tpusync.kv.handoff import pull, pull_plan
from tpusync.kv.keys import shard_key

# The axis tpu-inference splits a layer's cache on over tensor-parallel devices:
# [pages, page_size, kv heads x2 / packing, packing, head_dim] under PartitionSpec(BATCH,
# KV_CONTEXT, KV_HEAD) (tpu_inference/runner/kv_cache.py, create_kv_caches, 0.32.0).
KV_HEAD_AXIS = 2


class JaxWorkerSide(WorkerResults):
    """Called by the connector's worker-side methods on the model runner's thread. tpu-inference
    has no per-layer hooks: loads are whole before the forward, saves after it."""

    def __init__(self, cfg: ConnectorConfig, shards: int = 1, hosts: int = 1) -> None:
        super().__init__()
        self.cfg = cfg
        self.shards = shards  # the scheduler half keys blocks in this many shards
        self.hosts = hosts    # the slice's hosts (processes), each with its own sidecar
        self.runner: Any = None
        self.block_bytes = 0
        self.local_shards = 1  # the shards of each block this host holds
        self.link: StoreLink | None = None
        self.slice: SliceHost | None = None

    def register_runner(self, runner: Any) -> None:
        self.runner = runner
        self.block_bytes = pages.block_bytes(runner.kv_caches)  # one shard's part of a block
        shards, own = pages.host_shards(runner.kv_caches)
        if shards != self.shards or jax.process_count() != self.hosts:
            # Loads then fail (vLLM recomputes) and nothing is saved: wrong keys would serve wrong KV.
            log.error("tpusync connector (tpu-inference) stays off: the KV cache is split in %d shards over %d "
                      "hosts, the scheduler half keys blocks in %d shards (tensor_parallel_size) over %d hosts "
                      "(TPU_WORKER_HOSTNAMES)", shards, jax.process_count(), self.shards, self.hosts)
            return
        self.local_shards = len(own)
        self.link = StoreLink(self.cfg, self.block_bytes, "loads and saves")
        if self.hosts > 1:
            self.slice = SliceHost(self.cfg, self.block_bytes, runner, own, self.interval)
            self.host_info = self.slice.info  # sent with every answer
        log.info("tpusync connector (tpu-inference): %d layers of %s %s in %d shards (%s), %d bytes per shard "
                 "of a block", len(runner.kv_caches), runner.kv_caches[0].shape, runner.kv_caches[0].dtype, shards,
                 getattr(runner.kv_caches[0].sharding, "spec", "") if shards > 1 else "unsharded", self.block_bytes)

    def _fail(self, req_id: str, keys: list[int], block_ids: list[int]) -> None:
        """These blocks were offered but are not loaded: vLLM recomputes them."""
        if not block_ids:
            return
        self.errors.update(block_ids)
        self.failed.setdefault(req_id, []).append(keys[0])  # the rest follow from it
        self._count(load_error_blocks=len(block_ids))

    def start_load(self, meta: TPUSyncConnectorMetadata) -> None:
        if self.slice is not None:
            self.slice.release(meta.releases)
            self.slice.probe(meta.probes)
        if not meta.loads:
            return
        store = self.link.get() if self.link is not None else None
        for t in meta.loads:
            self.loaded.add(t.req_id)
            if store is None:
                self._fail(t.req_id, t.keys, t.block_ids)
                continue
            n, store = self._load(store, t)
            if self.slice is not None:  # loaded (or not): this host's pins for it go
                self.slice.unpin(t.req_id)
            self._count(loaded_blocks=n)
            if n < len(t.block_ids):  # pages: with blocks of another page size, not as many as keys
                log.warning("request %s: %d of %d blocks could not be loaded; vLLM recomputes them", t.req_id,
                            len(t.block_ids) - n, len(t.block_ids))
                self._fail(t.req_id, t.keys[t.key_index(n, self.runner.kv_caches[0].shape[1]):], t.block_ids[n:])

    def _load(self, store: Any, t: Any) -> tuple[int, Any]:
        """Loads one request's blocks: (blocks loaded, the store to go on with). A connection that
        fails (the sidecar restarted since it was opened, say) is replaced once, at once where
        retry_s allows, and the load tried again on the new one."""
        assert self.link is not None
        for attempt in range(2):
            try:
                if t.src_tokens or (t.shards and t.shards != self.shards):  # a prefill engine of another
                    # tensor parallelism or page size
                    self.runner.kv_caches, n = pages.load_pages_resharded(
                        store, t.keys, self.runner.kv_caches, t.block_ids, t.shards or self.shards, KV_HEAD_AXIS,
                        src_page_tokens=t.src_tokens, first_token=t.first_token)
                else:
                    self.runner.kv_caches, n = pages.load_pages(store, t.keys, self.runner.kv_caches, t.block_ids)
                return n, store
            except (errors.TpuSyncError, OSError) as e:
                self.link.failed(e)
                store = self.link.get() if attempt == 0 else None
                if store is None:
                    break
        return 0, None

    def wait_layer(self, layer_name: str) -> None:
        pass  # loads are whole before the forward

    def save_layer(self, layer_name: str, meta: TPUSyncConnectorMetadata) -> None:
        pass  # saved after the forward, in wait_for_save

    def wait_for_save(self, meta: TPUSyncConnectorMetadata | None) -> None:
        if meta is None or not meta.saves or self.runner is None or self.link is None:
            return
        store = self.link.get()
        if store is None:
            self._count(save_errors=1)
            return
        for t in meta.saves:
            try:
                written = pages.save_pages(store, t.keys, self.runner.kv_caches, t.block_ids)
            except errors.CapacityError as e:  # the pool is full of pinned blocks: skip, it is only a cache
                self._count(save_errors=1)
                log.warning("request %s: no room to save %d blocks (%s)", t.req_id, len(t.keys), e)
                continue
            except (errors.TpuSyncError, OSError) as e:
                self._count(save_errors=1)
                self.link.failed(e)
                return
            self._count(saved_blocks=written // (self.block_bytes * self.local_shards))  # this host's shards

    def take_worker_meta(self) -> TPUSyncWorkerMetadata | None:
        if self.slice is not None:
            self.probed = self.slice.take_answers()
        return super().take_worker_meta()

    def shutdown(self) -> None:
        if self.slice is not None:
            self.slice.shutdown()
        if self.link is not None:
            self.link.close()


def host_data_address(env: Mapping[str, str] | None = None) -> str | None:
    """This host's sidecar data port, from its own pod's environment: on a multi-host slice the
    connector's configuration (data_address) is the leader's, handed to every worker alike."""
    env = os.environ if env is None else env
    if env.get("TPUSYNC_DATA_ADDRESS"):
        return env["TPUSYNC_DATA_ADDRESS"]
    if env.get("POD_IP") and env.get("TPUSYNC_DATA_PORT"):
        return f"{env['POD_IP']}:{env['TPUSYNC_DATA_PORT']}"
    return None


class SliceHost:
    """One host's part in the scheduler's probes on a multi-host slice: on a thread of its own,
    pull the parts of the probed blocks this host's shards need from the prefill's hosts that
    hold them (or from peers), look them up and pin them in this host's sidecar, and answer with
    the leading blocks it holds every needed part of. Pins are held until the scheduler releases
    the request or its load ran here. Every probe still wanted is answered, 0 on any failure, so
    the scheduler never waits for a host that cannot answer better."""

    def __init__(self, cfg: ConnectorConfig, block_bytes: int, runner: Any, own: list[int],
                 interval: Interval) -> None:
        self.runner, self.own = runner, own
        self._count = interval.count  # the worker's: its pulls reach vLLM's metrics with the worker's stats
        self.index, self.count = jax.process_index(), jax.process_count()
        self.shards = pages.host_shards(runner.kv_caches)[0]
        self.info = {self.index: (host_data_address(), own)}
        self.link = StoreLink(cfg, block_bytes, "slice probes")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tpusync-probe")
        self.lock = threading.Lock()
        self.wanted: dict[str, int] = {}                     # request: the probe it waits on
        self.pins: dict[str, Pins] = {}                      # request: the parts pinned for it
        self.answers: dict[str, SliceAnswer] = {}

    def probe(self, probes: list[Probe]) -> None:
        for p in probes:
            with self.lock:
                self.wanted[p.req_id] = p.seq
            self.pool.submit(self._run, p)

    def release(self, req_ids: list[str]) -> None:
        """The scheduler is done with these requests' probes: their pins go, and so do the answers
        of probes still running."""
        for req_id in req_ids:
            with self.lock:
                self.wanted.pop(req_id, None)
            self.unpin(req_id)

    def unpin(self, req_id: str) -> None:
        with self.lock:
            pins = self.pins.pop(req_id, Pins())
        release_pins(self.link, pins)

    def take_answers(self) -> dict[str, SliceAnswer]:
        with self.lock:
            out, self.answers = self.answers, {}
        return out

    def _needed(self, src: int) -> list[int]:
        """The parts of a block stored split in `src` that this host's shards need."""
        if src == self.shards:
            return self.own
        return pages.source_parts(self.runner.kv_caches, src, KV_HEAD_AXIS)

    def _run(self, p: Probe) -> None:
        blocks = pulled = 0
        pinned = Pins()
        try:
            blocks, pulled, pinned = self._look(p)
        except Exception:  # noqa: BLE001 - a probe answers whatever happens
            log.exception("tpusync slice probe failed")
        with self.lock:
            if self.wanted.get(p.req_id) == p.seq:  # else released meanwhile: its pins go at once
                pinned, self.pins[p.req_id] = self.pins.get(p.req_id, Pins()), pinned
                self.answers[p.req_id] = SliceAnswer(p.seq, blocks, pulled, {self.index}, self.count)
        release_pins(self.link, pinned)

    def _look(self, p: Probe) -> tuple[int, int, Pins]:
        """(blocks held, blocks pulled, the pins taken) for one probe."""
        store = self.link.get()
        if store is None:
            return 0, 0, Pins()
        src = p.shards or self.shards
        needed = self._needed(src)
        per = len(needed)

        def parts(keys: list[int], shards: list[int]) -> list[int]:
            return [shard_key(k, m, src) for k in keys for m in shards]

        try:
            pulled = 0
            if p.pull:
                def fetch(peer: str, first: int, shards: list[int]) -> None:
                    store.read_remote(peer, parts(p.keys[first:p.pull], shards))

                def failed(peer: str, missing: int, e: errors.TpuSyncError) -> None:
                    self._count(peer_errors=1)
                    log.warning("pulling %d blocks from %s failed (%s)", missing, peer, e)

                plan = pull_plan(p.remote, p.remote_hosts, needed, self.index, p.peers) if p.remote else \
                    [(peer, needed) for peer in p.peers]
                pulled = pull(plan, p.pull, lambda: store.lookup(parts(p.keys[:p.pull], needed)).prefix_len // per,
                              fetch, failed).blocks
                self._count(pulled_blocks=pulled)
            keys = parts(p.keys, needed)
            found = store.lookup(keys, pin=True).prefix_len
            blocks = found // per
            if found > blocks * per:  # parts of a block past the whole ones
                store.release(keys[blocks * per:found])
            return blocks, pulled, Pins(store, keys[:blocks * per])
        except errors.TpuSyncError as e:
            self.link.failed(e)
            return 0, 0, Pins()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.link.close()

