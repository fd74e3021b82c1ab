"""The scheduler half of TPUSyncConnector: lookups and pins, peer pulls, the step's load and
save plans, and the kv_transfer_params of a finished prefill. Nothing here waits on a transfer:
a pull runs on a thread of its own and the scheduler is told to ask again."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tpusync import errors
from tpusync.engines.connector.common import Interval, log
from tpusync.engines.connector.config import ConnectorConfig
from tpusync.engines.connector.events import ConnectorEvents
from tpusync.engines.connector.link import Pins, StoreLink, release_pins
from tpusync.engines.connector.messages import (
    Probe,
    SliceAnswer,
    TPUSyncConnectorMetadata,
    TPUSyncWorkerMetadata,
    Transfer,
)
from tpusync.kv import served_weights
from tpusync.kv.handoff import (
    MalformedParams,
    RemotePrefill,
    layout_refusal,
    log_refusal,
    producer_params,
    pull,
    stored_blocks,
    vllm_prefill,
    wants_decode,
)
from tpusync.kv.keys import BlockScope
from tpusync.kv.served_weights import ServedWeights

if TYPE_CHECKING:
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class _Source:
    """A prefill engine's blocks where its pages hold another number of tokens than this
    engine's: its keys for the same prompt, and which of its blocks hold which of ours."""

    block_size: int
    keys: list[int]

    def span(self, block_size: int, start: int, stop: int) -> tuple[int, list[int]]:
        """(index of the first, keys) of its blocks that hold the tokens of our blocks [start, stop)."""
        first = start * block_size // self.block_size
        return first, self.keys[first:-(-stop * block_size // self.block_size)]

    def whole(self, block_size: int, start: int, first: int, blocks: int) -> int:
        """Our blocks from `start` that its `blocks` blocks from `first` hold whole."""
        return max(0, (first + blocks) * self.block_size // block_size - start)


@dataclass
class _Request:
    req_id: str
    tokens: list[int]               # the prompt (the request's own list)
    extra: list[str] | None         # what keys the blocks besides the tokens (LoRA, salt, weights)
    keys: list[int]                 # the prompt's full blocks
    usable: int                     # leading blocks that may be loaded: the last prompt token is computed
    remote: RemotePrefill | None
    pull: Future[int] | None = None  # the peer pull, once per request
    pulled: int = 0                 # blocks that pull brought
    pins: Pins = field(default_factory=Pins)
    load: tuple[int, int] | None = None  # (first block, blocks) offered by the last lookup
    saved: int = 0                  # leading prompt blocks in the store or being saved
    plain: bool = True              # keyed by the tokens alone (no LoRA, no cache salt): llm-d keys them alike
    shards: int = 0                 # the parts the prefill engine split its blocks in, where not as here
    src: _Source | None = None      # the prefill engine's blocks, where its page size is not ours
    # A multi-host slice: the request's outstanding Probe (the block it started at, its number)
    # and the hosts' answer so far.
    probed_at: int | None = None
    probe_seq: int = 0
    answer: SliceAnswer | None = None


class SchedulerSide:
    """Called by TPUSyncConnector's scheduler-side methods, on vLLM's scheduler thread."""

    def __init__(self, cfg: ConnectorConfig, scope: BlockScope, *, block_bytes: int, engine_id: str,
                 save: bool, pull: bool, kv_events: KVEventsConfig | None = None, dp_rank: int = 0,
                 hosts: int = 1) -> None:
        # What this engine's blocks depend on: their keys and the layout a prefill tells derive from it.
        self.cfg, self.scope, self.engine_id = cfg, scope, engine_id
        self.block_size, self.layout = scope.page_tokens, scope.layout()
        block_size = scope.page_tokens
        # A multi-host slice: each host's worker holds its shards in its own pod's sidecar, so the
        # hosts look up, pin and pull (Probe), and say what they hold (SliceAnswer).
        self.hosts = hosts
        self.probes: list[Probe] = []
        self.releases: list[str] = []
        self.slice: dict[int, tuple[str | None, list[int]]] = {}  # process index: data port, shards
        self._probe_seq = 0
        self.save, self.pull = save, pull
        self.link = StoreLink(cfg, block_bytes, "lookups")
        # A pull holds its connection for the whole transfer: give it its own.
        self.pull_link = StoreLink(cfg, block_bytes, "peer pulls")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tpusync-pull")
        self.reqs: dict[str, _Request] = {}
        self.loads: list[Transfer] = []
        self.saves: list[Transfer] = []
        self.awaiting_load: dict[str, Pins] = {}
        self.kv_cache_manager: Any = None
        self._warned_no_address = False
        self.interval = Interval()  # this half's counts, taken by vLLM each step (get_kv_connector_stats)
        self._count = self.interval.count
        # Blocks are keyed under the weights the engine serves (tpusync.kv.served_weights).
        served_weights.forget(engine_id)
        self.served = ServedWeights(engine_id)
        # vLLM's KV events are on: announce the blocks the store holds for this engine.
        self.events = None if kv_events is None else ConnectorEvents(
            cfg, block_size=block_size, block_bytes=block_bytes, vllm_events=kv_events, dp_rank=dp_rank)

    def _track(self, request: Request) -> _Request | None:
        st = self.reqs.get(request.request_id)
        if st is not None:
            return st
        tokens = request.prompt_token_ids
        if tokens is None or request.mm_features:
            return None  # prompt embeddings or multimodal inputs: the KV does not follow from token ids
        extra = []
        if request.lora_request is not None:
            extra.append(f"lora:{request.lora_request.lora_name}")
        if request.cache_salt:
            extra.append(f"salt:{request.cache_salt}")
        plain = not extra  # the weights' tag changes no token: llm-d's view of this pod still holds
        scope = self.scope.under(self.served.tag())  # blocks are keyed under the weights served
        st = _Request(req_id=request.request_id, tokens=tokens, extra=scope.extra(extra),
                      keys=scope.keys(tokens, extra), usable=(len(tokens) - 1) // self.block_size,
                      remote=self._remote(request) if self.pull else None, plain=plain)
        self._count(requests=1, handoffs=1 if st.remote is not None else 0)
        self.reqs[request.request_id] = st
        return st

    def _remote(self, request: Request) -> RemotePrefill | None:
        """The remote prefill the request's kv_transfer_params name, parsed once per request: any
        client may set them, and an exception here would stop the engine. A malformed field
        refuses the hand-off (logged, counted): the prompt is computed here."""
        try:
            return vllm_prefill(request.kv_transfer_params)
        except MalformedParams as e:
            self._count(refused_prefills=1, handoffs=1)  # offered, refused
            log_refusal(log, request.request_id, e)
            return None

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._track(request)
        if st is None:
            return 0, False
        start = num_computed_tokens // self.block_size
        if start >= st.usable:
            self._unpin(st)
            return 0, False
        if self.hosts > 1:
            return self._matched_on_slice(st, start)
        if st.pull is None:
            sources, limit = self._sources(st)
            if sources and limit > start:
                keys = st.keys[start:limit] if st.src is None else st.src.span(self.block_size, start, limit)[1]
                st.pull = self.pool.submit(self._pull, keys, sources, st.shards, st.remote)
            else:
                st.pull = _done(0)
        if not st.pull.done():
            return None, False  # the scheduler asks again next step
        st.pulled = st.pull.result()
        store = self.link.get()
        if store is None:
            return 0, False
        first, keys = (start, st.keys[start:st.usable]) if st.src is None else \
            st.src.span(self.block_size, start, st.usable)
        try:
            view = self.link.view(store, st.shards)
            found = pinned = held = view.lookup(keys, pin=True).prefix_len
            if st.src is not None:  # our blocks that its blocks hold whole; the others' pins go
                found = min(st.usable - start, st.src.whole(self.block_size, start, first, pinned))
                held = len(st.src.span(self.block_size, start, start + found)[1]) if found else 0
                if pinned > held:
                    view.release(keys[held:pinned])
        except errors.TpuSyncError as e:
            self.link.failed(e)
            return 0, False
        self._count(lookups=1)
        old, st.pins = st.pins, Pins(store, keys[:held], st.shards)
        release_pins(self.link, old)
        st.load = (start, found) if found else None
        return found * self.block_size, False

    def _matched_on_slice(self, st: _Request, start: int) -> tuple[int | None, bool]:
        """matched() on a multi-host slice: the hosts probe (pull, look up and pin their parts);
        the scheduler asks again until every host answered, then offers the blocks all hold."""
        if st.probed_at is not None and start < st.probed_at:  # vLLM's own prefix shrank: ask afresh
            self._unpin(st)
        if st.probed_at is None:
            sources, limit = self._sources(st)
            keys = st.keys[start:st.usable] if st.src is None else st.src.span(self.block_size, start, st.usable)[1]
            remote = st.remote if st.remote is not None and st.remote.peer in sources else None  # not refused
            pull = 0 if not sources or limit <= start else \
                limit - start if st.src is None else len(st.src.span(self.block_size, start, limit)[1])
            self._probe_seq += 1
            self.probes.append(Probe(
                st.req_id, keys, st.shards, seq=self._probe_seq, pull=pull,
                remote=(remote.addresses or [remote.peer]) if remote is not None else [],
                remote_hosts=remote.hosts if remote is not None else None,
                peers=[p for p in sources if remote is None or p != remote.peer]))
            st.probed_at, st.probe_seq, st.answer = start, self._probe_seq, None
            return None, False
        if st.answer is None or not st.answer.complete:
            return None, False  # the scheduler asks again next step
        at, held = st.probed_at, st.answer.blocks
        if st.src is not None:  # our blocks that its blocks hold whole
            first, _ = st.src.span(self.block_size, at, at)
            held = min(st.usable - at, st.src.whole(self.block_size, at, first, held))
        found = max(0, at + held - start)
        st.pulled = st.answer.pulled
        self._count(lookups=1)
        st.load = (start, found) if found else None
        return found * self.block_size, False

    def _sources(self, st: _Request) -> tuple[list[str], int]:
        """Peers to pull from, and how many leading blocks (of ours) they may have."""
        sources: list[str] = []
        limit = 0
        remote, bs = st.remote, self.block_size
        if remote is not None and remote.peer:
            theirs = remote.block_size or bs
            if theirs != bs and not self._regroups(remote):
                self._count(refused_prefills=1)
                log.warning("the prefill engine at %s used blocks of %d tokens, this engine %d: recomputing",
                            remote.peer, theirs, bs)
            elif (refused := layout_refusal(remote.layout, self.layout, reshards=self.link.reshards)) is not None:
                self._count(refused_prefills=1)
                log.warning("the prefill engine at %s holds other KV (%s): recomputing", remote.peer, refused)
            else:
                src = None if theirs == bs else _Source(theirs, self.scope.hasher(theirs).keys(
                    st.tokens, st.extra))
                stored = stored_blocks(remote, st.keys if src is None else src.keys, theirs)
                if stored is None:
                    self._count(refused_prefills=1)
                    log.warning("the prefill engine at %s keyed this prompt differently (another hash_seed or "
                                "prompt?): recomputing", remote.peer)
                else:
                    limit = min(st.usable, stored * theirs // bs)
                    shards = 0 if remote.shards is None or self.layout is None \
                        or remote.shards == self.layout["shards"] else remote.shards
                    if src is not None or shards:
                        # Blocks split or paged otherwise: only the prefill engine's sidecar holds them so.
                        st.src, st.shards = src, shards
                        return [remote.peer], limit
                    sources.append(remote.peer)
        for peer in self.cfg.peers:
            if peer not in sources:
                sources.append(peer)
                limit = st.usable
        return sources, limit

    def _regroups(self, remote: RemotePrefill) -> bool:
        """Whether blocks of a prefill engine whose pages hold another number of tokens can be
        loaded here: by a worker that loads blocks paged otherwise, from a prefill that told its
        KV layout (checked by `layout_refusal` like any other)."""
        return self.link.reshards and remote.layout is not None and self.layout is not None

    def _pull(self, keys: list[int], sources: list[str], shards: int = 0, remote: RemotePrefill | None = None) -> int:
        """Has the sidecar fetch the blocks of `keys` it lacks from the first peers that have
        them (stored in `shards` parts, 0: as here; the contract's pull loop); from a multi-host
        prefill, each part from the host that holds it. Returns how many arrived; never raises."""
        try:
            store = self.pull_link.get()
            if store is None:
                return 0
            store = self.pull_link.view(store, shards)
            parts = list(range(getattr(store, "shards", 1)))
            if remote is not None and remote.addresses is not None and hasattr(store, "read_parts"):
                # blocks stored in parts (tpu-inference): each from the prefill host that holds it
                plan = remote.pulls(parts, 0, [p for p in sources if p != remote.peer])
            else:
                plan = [(peer, parts) for peer in sources]

            def fetch(peer: str, first: int, held_parts: list[int]) -> None:
                if held_parts != parts:
                    store.read_parts(peer, keys[first:], held_parts)
                else:
                    store.read_remote(peer, keys[first:])

            def failed(peer: str, missing: int, e: errors.TpuSyncError) -> None:
                self._count(peer_errors=1)
                log.warning("pulling %d blocks from %s failed (%s); recomputing what is missing", missing, peer, e)

            try:
                arrived = pull(plan, len(keys), lambda: store.lookup(keys).prefix_len, fetch, failed).blocks
            except errors.TpuSyncError as e:  # this host's sidecar
                self.pull_link.failed(e)
                return 0
            self._count(pulled_blocks=arrived)
            return arrived
        except Exception:  # noqa: BLE001 - never let a pull take the scheduler down
            log.exception("tpusync pull failed")
            return 0

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        n = num_external_tokens // self.block_size
        if not n or st.load is None:
            self._unpin(st)
            return
        if self.hosts > 1:
            self._after_alloc_on_slice(request, st, blocks, n)
            return
        start, found = st.load
        n = min(n, found)
        block_ids = blocks.get_block_ids()[0]
        transfer = self._transfer(st, request.request_id, block_ids, start, n)
        self.loads.append(transfer)
        m = len(transfer.keys)  # the pins this load holds
        pins, st.pins, st.load = st.pins, Pins(), None
        release_pins(self.link, replace(pins, keys=pins.keys[m:]))
        release_pins(self.link, self.awaiting_load.pop(request.request_id, Pins()))  # a load before a preemption
        self.awaiting_load[request.request_id] = replace(pins, keys=pins.keys[:m])
        self._saved_after_load(st, request.request_id, block_ids, start, n)

    def _after_alloc_on_slice(self, request: Request, st: _Request, blocks: KVCacheBlocks, n: int) -> None:
        """after_alloc on a multi-host slice: each host loads its parts and then drops its pins."""
        assert st.load is not None
        start, found = st.load
        n = min(n, found)
        self.loads.append(self._transfer(st, request.request_id, blocks.get_block_ids()[0], start, n))
        st.load, st.probed_at, st.answer = None, None, None
        self._saved_after_load(st, request.request_id, blocks.get_block_ids()[0], start, n)

    def _transfer(self, st: _Request, req_id: str, block_ids: list[int], start: int, n: int) -> Transfer:
        """The load of our blocks [start, start + n) into `block_ids`."""
        if st.src is None:
            return Transfer(req_id, st.keys[start:start + n], block_ids[start:start + n], st.shards)
        first, keys = st.src.span(self.block_size, start, start + n)
        return Transfer(req_id, keys, block_ids[start:start + n], st.shards, src_tokens=st.src.block_size,
                        first_token=start * self.block_size - first * st.src.block_size)

    def _saved_after_load(self, st: _Request, req_id: str, block_ids: list[int], start: int, n: int) -> None:
        if self.save and start > st.saved:  # vLLM's own prefix hit: make sure the store has it too
            self.saves.append(Transfer(req_id, st.keys[st.saved:start], block_ids[st.saved:start]))
        if st.src is None:  # else the store holds them under the prefill's keys: saved under ours after the step
            st.saved = max(st.saved, start + n)
        self._count(matched_requests=1, matched_tokens=n * self.block_size)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        st = self.reqs.get(request.request_id)
        if not num_external_tokens:
            return {}
        pulled = 0 if st is None else st.pulled * (st.src.block_size if st.src else self.block_size)
        p2p = min(num_external_tokens, pulled)
        out = {CacheHitSource.P2P: p2p, CacheHitSource.HOST: num_external_tokens - p2p}
        return {k: v for k, v in out.items() if v}

    def build_meta(self, so: SchedulerOutput) -> TPUSyncConnectorMetadata:
        meta = TPUSyncConnectorMetadata(loads=self.loads, saves=self.saves, probes=self.probes,
                                        releases=self.releases)
        self.loads, self.saves, self.probes, self.releases = [], [], [], []
        if self.save:
            for new in so.scheduled_new_reqs:
                self._plan_save(meta, new.req_id, new.num_computed_tokens, so.num_scheduled_tokens.get(new.req_id, 0))
            cached = so.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                self._plan_save(meta, req_id, cached.num_computed_tokens[i], so.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _plan_save(self, meta: TPUSyncConnectorMetadata, req_id: str, computed: int, scheduled: int) -> None:
        """Saves the prompt blocks this step completes."""
        st = self.reqs.get(req_id)
        if st is None:
            return
        done = min(len(st.keys), (computed + scheduled) // self.block_size)
        if done <= st.saved:
            return
        if self.kv_cache_manager is None:
            return  # vLLM did not bind its KV cache manager: no block ids to save from
        block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
        meta.saves.append(Transfer(req_id, st.keys[st.saved:done], list(block_ids[st.saved:done])))
        st.saved = done

    def connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, TPUSyncWorkerMetadata):
            return
        self.slice.update(meta.hosts)
        for req_id, answer in meta.probed.items():
            st = self.reqs.get(req_id)
            if st is None or st.probed_at is None or answer.seq != st.probe_seq:
                continue  # an answer to a probe since released: the hosts dropped its pins
            if st.answer is None:
                st.answer = answer
            else:
                st.answer.merge(answer)
        for req_id in meta.loaded:
            release_pins(self.link, self.awaiting_load.pop(req_id, Pins()))
        for req_id, keys in meta.failed.items():
            # vLLM recomputes these blocks: store them again, in place of what could not be loaded.
            st = self.reqs.get(req_id)
            if st is not None and keys and keys[0] in st.keys:
                st.saved = min(st.saved, st.keys.index(keys[0]))
            if st is None or not (st.shards or st.src):  # not the prefill engine's split: its sidecar's to keep
                self._drop(keys)

    def _drop(self, keys: list[int]) -> None:
        """Evicts blocks from every tier of the store (a block of the wrong size, say)."""
        store = self.link.get()
        if store is None or not keys:
            return
        try:
            for _ in range(2):  # DRAM, then disk
                present = [k for k, tier in zip(keys, store.lookup(keys).tiers) if tier]
                if not present:
                    break
                store.evict(present)
        except errors.TpuSyncError as e:
            log.warning("could not evict %d unloadable blocks: %s", len(keys), e)

    def finished(self, request: Request) -> dict[str, Any] | None:
        from vllm.v1.request import RequestStatus

        st = self.reqs.pop(request.request_id, None)
        release_pins(self.link, self.awaiting_load.pop(request.request_id, Pins()))
        if st is None:
            return None
        self._unpin(st)
        self._announce(request, st)
        if not self.save:
            return None
        try:
            if not wants_decode(request.kv_transfer_params):
                return None
        except MalformedParams as e:  # any client may set them: refused, never raised into the scheduler
            self._count(refused_prefills=1)
            log_refusal(log, request.request_id, e)
            return None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return None
        if not self.cfg.data_address and not self._warned_no_address:
            log.warning("no data_address configured (kv_connector_extra_config or $TPUSYNC_DATA_ADDRESS): decode "
                        "engines find this engine's blocks only in a store they share")
            self._warned_no_address = True
        n = st.saved
        hosts = [self.slice[i] for i in range(self.hosts)] if self.hosts > 1 and len(self.slice) == self.hosts \
            else None
        return producer_params(data_address=self.cfg.data_address, engine_id=self.engine_id,
                               request_id=request.request_id, num_tokens=n * self.block_size,
                               block_size=self.block_size, last_key=st.keys[n - 1] if n else None,
                               layout=self.layout, hosts=hosts)

    def _announce(self, request: Request, st: _Request) -> None:
        """Tells the router which of the prompt's blocks this engine can load from the store, and
        from which tier: saved here, loaded, pulled from a peer or received by P/D alike."""
        if self.events is None or not st.keys or not st.plain:
            return  # LoRA and salted prompts: llm-d would key their tokens as plain text
        store = self.link.get()
        if store is None:
            return  # no store, no claim: the router's index is left as it was
        try:
            found = store.lookup(st.keys)
        except errors.TpuSyncError as e:
            self.link.failed(e)
            return
        tokens = list(request.prompt_token_ids or ())[:len(st.keys) * self.block_size]
        self.events.announce(st.keys, tokens, list(found.tiers), found.prefix_len)

    def reset(self) -> None:
        """vLLM reset its caches (on pause with clear_cache, around a weight update): requests are
        keyed afresh, under the weights the engine serves when they are next scheduled."""
        for st in self.reqs.values():
            self._unpin(st)
        self.reqs.clear()
        self.served.reset()

    def take_events(self) -> list[KVCacheEvent]:
        return self.events.take() if self.events is not None else []

    def _unpin(self, st: _Request) -> None:
        pins, st.pins, st.load = st.pins, Pins(), None
        release_pins(self.link, pins)
        if st.probed_at is not None:  # the hosts hold pins for it (or will, when their probe ends)
            self.releases.append(st.req_id)
            st.probed_at, st.answer = None, None

    def shutdown(self) -> None:
        if self.events is not None:
            self.events.shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.link.close()
        self.pull_link.close()


def _done(value: int) -> Future[int]:
    f: Future[int] = Future()
    f.set_result(value)
    return f
