"""The reference engine: one request at a time, prefix cache and P/D transfer through tpusync.

Roles:
- `prefill`: computes the prompt, saves its full pages to the store (its sidecar), returns the
  first token and `kv_transfer_params` naming where the blocks are.
- `decode`: given `kv_transfer_params`, pulls through its sidecar only the blocks it lacks,
  loads them, computes the prompt's tail and generates.
- `both`: everything in one server.
Every role looks up the longest cached prefix (DRAM, disk, then the configured peers) and
computes only the rest. If the store or a peer fails, or holds a block that is not a page of
this model, it recomputes: never wrong tokens. Why it failed goes to the log, not to clients.

On a multi-host slice (`tpusync.engines.reference.slice`) every process runs each request in lockstep;
each host moves its own shards of every page through its own sidecar, and the slice computes
from the shortest prefix its hosts hold.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpusync import errors
from tpusync.engines.reference.model import ModelConfig, empty_cache, forward, init_params, span_for
from tpusync.engines.reference.slice import Slice
from tpusync.kv import handoff
from tpusync.kv.events import BlockAnnouncer, EventSink, block_tier, follow, tiers_of
from tpusync.kv.keys import BlockScope, event_hash_of, key_of, shard_key
from tpusync.kv.pages import (
    KV_HEAD_AXIS,
    KV_PAGE_AXIS,
    compile_loads,
    host_shards,
    load_pages,
    load_pages_resharded,
    save_pages,
    source_parts,
)
from tpusync.kv.path_metrics import PathCounters
from tpusync.store import KVStore

log = logging.getLogger("tpusync.serving")
ROLES = ("prefill", "decode", "both")

@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose KV was loaded, not computed
    computed_tokens: int = 0
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    transfer_seconds: float = 0.0   # pulling from the prefill server or a peer
    load_seconds: float = 0.0       # store -> KV cache
    prefill_seconds: float = 0.0    # computing the uncached part of the prompt
    save_seconds: float = 0.0
    ttft_seconds: float = 0.0       # arrival to the first token
    # Why the store or a peer failed, for the log and in-process callers: it may name a peer's
    # address or a socket error, so as_dict() (what a client gets) says only that one failed.
    store_error: str = ""
    kv_events_seq: int = -1         # the KV-event batch this request published, -1 if none

    def as_dict(self) -> dict[str, Any]:
        """The stats a client may see: "prefix_cache" is "unavailable" when the store or a peer
        failed during the request (the rest was recomputed), else "ok"."""
        out = {k: v for k, v in self.__dict__.items() if k != "store_error"}
        out["prefix_cache"] = "unavailable" if self.store_error else "ok"
        return out


@dataclass
class Result:
    tokens: list[int]
    kv_transfer_params: dict[str, Any] | None
    stats: RequestStats = field(default_factory=RequestStats)


class Engine:
    def __init__(self, cfg: ModelConfig, *, role: str = "both", store: KVStore | None = None,
                 data_address: str | None = None, peers: list[str] | None = None, hash_seed: str = "tpusync",
                 prefix_cache: bool = True, kv_events: EventSink | None = None, kv_events_audit_s: float = 2.0,
                 kv_events_feed: KVStore | None = None, slice: Slice | None = None,
                 reconnect: Callable[[], KVStore] | None = None, model: str = "tpusync/reference") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        cfg.validate()
        if slice is not None:
            if cfg.kv_heads % slice.devices:
                raise errors.InvalidArgumentError(f"kv_heads ({cfg.kv_heads}) must be a multiple of the slice's "
                                                  f"{slice.devices} devices: each holds whole heads")
            if kv_events_feed is not None:
                raise errors.InvalidArgumentError("a slice follows no one sidecar's change feed: its leader audits "
                                                  "every host's sidecar in lockstep (kv_events_audit_s)")
        if store is not None and store.block_bytes < cfg.page_bytes:
            raise ValueError(f"store blocks of {store.block_bytes} bytes cannot hold a page of {cfg.page_bytes}")
        if data_address and handoff.split_literal(data_address) is None:
            # Decode servers refuse a hand-off naming anything else (tpusync.kv.handoff): say so now.
            raise errors.InvalidArgumentError(f"data_address must be a literal ip:port, not {data_address!r}")
        self.cfg, self.role, self.store = cfg, role, store
        # Opens the sidecar connection again: a restarted sidecar (its pool survived) is used at once.
        self._reconnect = reconnect
        self.data_address, self.peers, self.prefix_cache = data_address, peers or [], prefix_cache
        self.engine_id = f"tpusync-reference-{uuid.uuid4().hex}"  # remote_engine_id in kv_transfer_params
        # KV events (a tpusync.kv.events.KVEventPublisher, or None): what this engine can load
        # from its store instead of computing, for llm-d's precise prefix-cache routing.
        self.announcer = BlockAnnouncer(kv_events, cfg.page_size) if kv_events is not None else None
        self.kv_events_audit_s = kv_events_audit_s
        if self.announcer is not None and store is not None and prefix_cache and kv_events_audit_s > 0 \
                and slice is None:  # a slice's leader audits in lockstep (keep_slice_alive)
            # The sidecar demotes and evicts on its own: every few seconds, ask where the blocks
            # this engine announced are now, so the router stops sending their prefixes here.
            threading.Thread(target=self._audit_loop, args=(self.announcer, kv_events_audit_s), daemon=True,
                             name="kv-events-audit").start()
        if self.announcer is not None and kv_events_feed is not None and prefix_cache:
            # `kv_events_feed` (a connection of its own to the same store) reports each block the
            # store demotes or evicts as it does, and the blocks other hosts publish on or remove
            # from the shared tier at the sidecar's scans: announced at once (kv_events.follow).
            threading.Thread(target=self._follow_loop, args=(self.announcer, kv_events_feed), daemon=True,
                             name="kv-events-feed").start()
        self.slice = slice
        # On a slice, whether requests end in the KV-event collective: the leader's announcer says,
        # and tells the followers with each request (they publish nothing themselves).
        self.slice_announces = self.announcer is not None
        self.host_index = slice.cfg.process_id if slice is not None else 0
        self.params = init_params(cfg) if slice is None else jax.tree.map(self._replicated, init_params(cfg))
        self.k, self.v = self._empty_cache()
        # The data ports of every host of the slice, for kv_transfer_params (process order), and the
        # shards of the cache each holds.
        self.slice_addresses = slice.gather_text(data_address or "") if slice is not None else []
        self.shards, mine = host_shards([self.k, self.v], page_axis=KV_PAGE_AXIS)
        self.host_shards = ([[int(n) for n in t.split(",")] for t in slice.gather_text(",".join(map(str, mine)))]
                            if slice is not None else [mine])
        # Everything the bytes of this engine's blocks depend on (tpusync.kv.keys.BlockScope): its keys
        # and the layout kv_transfer_params tell derive from it.
        self.scope = BlockScope(model=model, dtype=cfg.dtype, layers=cfg.layers, kv_heads=cfg.kv_heads,
                                head_size=cfg.head_dim, page_tokens=cfg.page_size, format=handoff.FORMAT_REFERENCE,
                                shards=self.shards, seed=hash_seed)
        self.hasher, self.layout = self.scope.hasher(), self.scope.layout()
        self.lock = threading.Lock()
        self.kv_path = PathCounters()  # what the KV path did, on /metrics (tpusync.kv.path_metrics)
        self.running = 0
        self.waiting = 0
        self.pages_in_use = 0

    def _replicated(self, x: jax.Array) -> jax.Array:
        assert self.slice is not None
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, self.slice.sharding(None, host.ndim), lambda i: host[i])

    def _empty_cache(self) -> tuple[jax.Array, jax.Array]:
        """The KV cache, on a slice sharded over its devices by kv heads (axis 3)."""
        if self.slice is None:
            return empty_cache(self.cfg)
        cfg = self.cfg
        shape = (cfg.layers, cfg.pages, cfg.page_size, cfg.kv_heads, cfg.head_dim)
        sharding = self.slice.sharding(3, len(shape))
        shard = sharding.shard_shape(shape)
        k, v = (jax.make_array_from_callback(shape, sharding, lambda _: np.zeros(shard, cfg.dtype)) for _ in range(2))
        return k, v

    def _token(self, logits: jax.Array, row: int) -> int:
        """The greedy token of one row of logits (replicated on every process of a slice)."""
        if self.slice is None:
            return int(jnp.argmax(logits[row]))
        return int(_argmax_replicated(self.slice)(logits, row))

    # -- the request path ----------------------------------------------------------------

    def generate(self, prompt: list[int], max_tokens: int, *, kv_transfer_params: dict[str, Any] | None = None,
                 on_token: Callable[[int], None] | None = None, request_id: str = "-") -> Result:
        """Greedy decoding. `on_token(token)` is called as each token is produced. `request_id`
        names the request in the log."""
        cfg = self.cfg
        if not prompt:
            raise errors.InvalidArgumentError("the prompt is empty")
        if any(not 0 <= t < cfg.vocab for t in prompt):
            raise errors.InvalidArgumentError(f"token ids must be in [0, {cfg.vocab})")
        if len(prompt) + max_tokens > cfg.max_seq:
            raise errors.InvalidArgumentError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds "
                                              f"max_seq ({cfg.max_seq})")
        arrived = time.perf_counter()
        self.waiting += 1
        with self.lock:
            self.waiting -= 1
            self.running += 1
            try:
                if self.slice is not None:  # every process of the slice runs it, in this order
                    self.slice.broadcast({"op": "generate", "prompt": prompt, "max_tokens": max_tokens,
                                          "kv_transfer_params": kv_transfer_params, "request_id": request_id,
                                          "announce": self.slice_announces})
                return self._generate(prompt, max_tokens, kv_transfer_params, on_token, arrived, request_id)
            finally:
                self.running -= 1
                self.pages_in_use = 0

    def follow_leader(self) -> None:
        """A follower of a slice: runs what the leader broadcasts until it says stop."""
        assert self.slice is not None and not self.slice.leader
        while True:
            message = self.slice.broadcast(None)
            if message.get("op") == "stop":
                return
            if message.get("op") == "generate":
                self.slice_announces = bool(message.get("announce"))
                self._generate(message["prompt"], message["max_tokens"], message.get("kv_transfer_params"), None,
                               time.perf_counter(), str(message.get("request_id", "-")))
            elif message.get("op") == "where":
                self._slice_where([int(k, 16) for k in message["keys"]])

    def keep_slice_alive(self, every_s: float = 30.0) -> None:
        """The leader, on a thread of its own: an empty broadcast when idle, so that followers
        waiting in the collective never reach its timeout; with KV events, an audit of every
        announced block on every host's sidecar each `kv_events_audit_s` instead."""
        assert self.slice is not None and self.slice.leader
        auditing = self.announcer is not None and self.store is not None and self.prefix_cache \
            and self.kv_events_audit_s > 0
        period = min(every_s, self.kv_events_audit_s) if auditing else every_s
        asked = False

        def where(keys: list[int]) -> list[int]:  # the announcer's lookup: every host, in lockstep
            nonlocal asked
            asked = True
            assert self.slice is not None
            self.slice.broadcast({"op": "where", "keys": [f"{k:032x}" for k in keys]})
            return self._slice_where(keys)

        while True:
            time.sleep(period)  # a period, not a synchronisation
            if not self.lock.acquire(blocking=False):  # busy: a request is a broadcast too
                continue
            try:
                asked = False
                if auditing:
                    assert self.announcer is not None
                    self.announcer.audit(where)
                if not asked:  # nothing remembered to audit: a broadcast all the same
                    self.slice.broadcast(None)
            finally:
                self.lock.release()

    def stop_slice(self) -> None:
        """The leader: tells the followers to exit."""
        assert self.slice is not None and self.slice.leader
        with self.lock:
            self.slice.broadcast({"op": "stop"})

    def _generate(self, prompt: list[int], max_tokens: int, kv_params: dict[str, Any] | None,
                  on_token: Callable[[int], None] | None, arrived: float, request_id: str) -> Result:
        cfg, st = self.cfg, RequestStats(prompt_tokens=len(prompt))
        digests = self.hasher.digests(prompt)
        keys = [key_of(d) for d in digests]
        self.pages_in_use = -(-(len(prompt) + max_tokens) // cfg.page_size)

        cached_pages, own_pages = self._bring_prefix(prompt, keys, self._handoff(kv_params, request_id), st)
        # Resume at a chunk boundary, and always compute the chunk holding the last prompt token:
        # its logits give the first token.
        start = min(cached_pages * cfg.page_size, len(prompt) - 1) // cfg.chunk * cfg.chunk
        st.cached_tokens = start
        t0 = time.perf_counter()
        logits = None
        for c in range(start, len(prompt), cfg.chunk):
            chunk = prompt[c:c + cfg.chunk]
            padded = jnp.asarray(chunk + [0] * (cfg.chunk - len(chunk)), jnp.int32)
            logits, self.k, self.v = forward(self.params, self.k, self.v, padded, jnp.int32(c), cfg=cfg,
                                             n=cfg.chunk, span=span_for(cfg, c + cfg.chunk))
            last = len(chunk) - 1
        assert logits is not None  # start <= len(prompt) - 1: the loop ran at least once
        token = self._token(logits, last)
        st.computed_tokens = len(prompt) - start
        st.prefill_seconds = time.perf_counter() - t0
        st.ttft_seconds = time.perf_counter() - arrived
        if on_token:
            on_token(token)

        self._save_prompt(keys, own_pages, st)
        if self.slice is not None and self.store is not None:  # every host saved before the response names them
            self.slice.agree([0])
        self._announce(prompt, digests, keys, st)
        out = [token]
        if self.role == "prefill":
            return Result(out, self._transfer_params(keys, request_id), st)
        pos = len(prompt)
        while len(out) < max_tokens:
            logits, self.k, self.v = forward(self.params, self.k, self.v, jnp.asarray([token], jnp.int32),
                                             jnp.int32(pos), cfg=cfg, n=1, span=span_for(cfg, pos + 1))
            token = self._token(logits, 0)
            out.append(token)
            pos += 1
            if on_token:
                on_token(token)
        return Result(out, None, st)

    def _bring_prefix(self, prompt: list[int], keys: list[int], remote: handoff.RemotePrefill | None,
                      st: RequestStats) -> tuple[int, int]:
        """Makes the longest available prefix of `keys` local and loads it (on a slice, the pages
        every host loaded its shards of). Returns its pages, and how many of them the store holds
        under this engine's own keys (fewer when they came split otherwise: saved again)."""
        if self.store is None or not keys or not (self.prefix_cache or remote):
            return 0, 0
        loaded, own = self._bring_shards(prompt, keys, remote, st)
        if st.store_error and self._reconnected():  # once more, on the restarted sidecar
            st.store_error = ""
            loaded, own = self._bring_shards(prompt, keys, remote, st)
        if self.slice is not None:  # a collective: every process reaches it
            loaded, own, ok, slowest = self.slice.agree([loaded, own, 0 if st.store_error else 1,
                                                         -round(st.transfer_seconds * 1e6)])
            if not ok and not st.store_error:
                st.store_error = "the store or a peer of another host of the slice failed"
            st.transfer_seconds = -slowest / 1e6  # the hosts pull in parallel: the slice waits for the last
        return loaded, own

    def _bring_shards(self, prompt: list[int], keys: list[int], remote: handoff.RemotePrefill | None,
                      st: RequestStats) -> tuple[int, int]:
        """This host's part of _bring_prefix: the parts of each block its shards need (its own
        shards' blocks, or the prefill's parts they overlap when the prefill split its heads
        otherwise, or the prefill's blocks of another page size, keyed here at that size), from
        its store, the prefill's hosts and peers."""
        assert self.store is not None
        cfg = self.cfg
        remote, src_shards, src_page = self._prefill_blocks(remote)
        try:
            if src_page != cfg.page_size:  # the prompt keyed as the prefill keyed it
                src_keys = [key_of(d) for d in self.scope.hasher(src_page).digests(prompt)]
            else:
                src_keys = keys
            if remote is not None and handoff.stored_blocks(remote, src_keys, src_page) is None:
                self.kv_path.add(refused_handoffs=1)
                log.warning("the prefill engine at %s keyed this prompt differently (another hash_seed or prompt?): "
                            "not pulling its KV", remote.peer)
                remote = None
            resharded = src_shards != self.shards or src_page != cfg.page_size
            if src_shards != self.shards:
                needed = source_parts([self.k], src_shards, KV_HEAD_AXIS)
            else:
                needed = self.host_shards[self.host_index]
            host_keys = [shard_key(k, m, src_shards) for k in src_keys for m in needed]
            per = len(needed)
            peers = self.peers if self.prefix_cache and not resharded else []
            plan = remote.pulls(needed, self.host_index, peers) if remote is not None else \
                [(p, needed) for p in dict.fromkeys(peers)]
            store = self.store

            def fetch(peer: str, first: int, shards: list[int]) -> None:
                store.read_remote(peer, [shard_key(k, m, src_shards) for k in src_keys[first:] for m in shards])

            def failed(peer: str, missing: int, e: errors.TpuSyncError) -> None:
                st.store_error = str(e)
                self.kv_path.add(pull_failures=1)
                log.warning("peer %s unavailable: %s", peer, e)

            t0 = time.perf_counter()
            try:
                def present() -> int:
                    return store.lookup(host_keys).prefix_len // per

                got = handoff.pull(plan, len(src_keys), present, fetch, failed)
            finally:
                st.transfer_seconds += time.perf_counter() - t0
            local = got.local
            for p in got.pulled:
                st.pulled_blocks += p.blocks
                st.pulled_bytes += p.blocks * cfg.page_bytes * src_page // cfg.page_size * len(p.parts) // src_shards
            t0 = time.perf_counter()
            if resharded:
                (self.k, self.v), loaded = load_pages_resharded(
                    self.store, src_keys[:local], [self.k, self.v], list(range(len(keys))), src_shards, KV_HEAD_AXIS,
                    page_axis=KV_PAGE_AXIS, src_page_tokens=0 if src_page == self.cfg.page_size else src_page)
            else:
                (self.k, self.v), loaded = load_pages(self.store, keys[:local], [self.k, self.v], list(range(local)),
                                                      page_axis=KV_PAGE_AXIS)
            st.load_seconds = time.perf_counter() - t0
            self.kv_path.add(pulled_blocks=sum(p.blocks for p in got.pulled), loaded_blocks=loaded,
                             recomputed_blocks=max(0, local - loaded))
            if loaded < local and not resharded:  # a block held, but not as a page of this model (or gone since)
                self._evict_unloadable(host_keys[loaded * per:(loaded + 1) * per], st)
            return loaded, 0 if resharded else loaded
        except errors.TpuSyncError as e:  # a dead sidecar or peer: recompute, never fail or guess
            st.store_error = str(e)
            log.warning("prefix cache unavailable, recomputing: %s", e)
            self.k, self.v = self._empty_cache() if self.k.is_deleted() else (self.k, self.v)
            return 0, 0

    def _handoff(self, kv_params: object, request_id: str) -> handoff.RemotePrefill | None:
        """The prefill a request's kv_transfer_params name (tpusync.kv.handoff, vLLM's dialect). A
        client sends them, and the sidecar is asked to pull from the addresses in them: a malformed
        field refuses them whole (logged once, naming the field; the prompt is computed here), never
        passed on. None for none (or {}), as for a refused one."""
        remote = None
        try:
            remote = handoff.vllm_prefill(kv_params) if kv_params else None
        except handoff.MalformedParams as e:
            self.kv_path.add(handoffs=1, refused_handoffs=1)
            handoff.log_refusal(log, request_id, e)
        else:
            self.kv_path.add(handoffs=1 if remote is not None else 0)
        self.kv_path.add(requests=1)
        return remote

    def _prefill_blocks(self, remote: handoff.RemotePrefill | None) -> tuple[handoff.RemotePrefill | None, int, int]:
        """(the hand-off to pull from, the parts and the tokens of each of its blocks): its layout's
        split and block size where it told its layout and the contract's layout check lets this
        engine load them (regrouped where they differ), else this engine's own (None: no pull)."""
        cfg = self.cfg
        if remote is None or remote.layout is None:
            return remote, self.shards, cfg.page_size
        refused = handoff.layout_refusal(remote.layout, self.layout, reshards=True)
        page = remote.block_size or cfg.page_size
        if refused is None and page > cfg.max_seq:
            refused = f"blocks of {page} tokens, this model's max_seq is {cfg.max_seq}"
        if refused is not None:  # never loaded: only this host's own cache and peers
            self.kv_path.add(refused_handoffs=1)
            log.warning("not pulling the prefill's KV: %s", refused)
            return None, self.shards, cfg.page_size
        return remote, int(remote.layout["shards"]), page

    def _evict_unloadable(self, keys: list[int], st: RequestStats) -> None:
        """Evicts a block (its shards held here) that could not be loaded (the wrong length), from
        DRAM and then disk, so that the page computed in its stead is what gets stored, and
        loaded next time."""
        assert self.store is not None
        try:
            present = [k for k, t in zip(keys, self.store.where(keys).tolist()) if t]
            if not present:
                return  # gone since the lookup: nothing to replace
            log.warning("block %032x is stored but is not a page of this model: recomputing it", present[0])
            for _ in range(2):  # DRAM, then disk
                self.store.evict(present)
                present = [k for k, t in zip(present, self.store.where(present).tolist()) if t]
                if not present:
                    return
        except errors.TpuSyncError as e:  # it stays a miss, recomputed each time
            st.store_error = str(e)
            log.warning("could not evict block %032x: %s", keys[0], e)

    def _save_prompt(self, keys: list[int], cached_pages: int, st: RequestStats) -> None:
        if self.store is None or not (self.prefix_cache or self.role == "prefill"):
            return
        t0 = time.perf_counter()
        for attempt in range(2):
            try:
                save_pages(self.store, keys[cached_pages:], [self.k, self.v], list(range(cached_pages, len(keys))),
                           page_axis=KV_PAGE_AXIS)
                self.kv_path.add(saved_blocks=max(0, len(keys) - cached_pages))
                break
            except errors.TpuSyncError as e:
                if attempt == 0 and self._reconnected():  # once more, on the restarted sidecar
                    continue
                st.store_error = str(e)
                log.warning("could not save the prompt's KV: %s", e)
                return
        st.save_seconds = time.perf_counter() - t0

    def _reconnected(self) -> bool:
        """After a store error: whether the sidecar connection was dead (the sidecar restarted or
        went away) and a new one is open. False when it is alive (the error was a peer's or a
        block's) or the sidecar is still away (the next error tries again)."""
        if self._reconnect is None or self.store is None:
            return False
        try:
            self.store.stats()
            return False
        except errors.TpuSyncError:
            pass
        try:
            store = self._reconnect()
        except errors.TpuSyncError as e:
            log.warning("the sidecar is still away: %s", e)
            return False
        old, self.store = self.store, store
        with contextlib.suppress(errors.TpuSyncError):  # a dead connection: nothing held on it survives
            old.close()
        log.info("reconnected to the restarted sidecar")
        return True

    def _announce(self, prompt: list[int], digests: list[bytes], keys: list[int], st: RequestStats) -> None:
        """Tells the router which of the prompt's blocks this engine can now load, and from which
        tier: the ones it computed, pulled from a peer or the prefill server, or found stored."""
        if self.store is None or not self.prefix_cache or not keys:
            return
        if self.slice is not None:  # a collective: every process reaches it, the leader announces
            if not self.slice_announces:
                return
            tiers = self._slice_where(keys)
            held = next((i for i, t in enumerate(tiers) if not t), len(tiers))
        elif self.announcer is not None:
            try:
                found = self.store.lookup(keys)
            except errors.TpuSyncError as e:  # no store, no claim: the router's index is left as it was
                log.warning("could not look up the prompt's blocks for KV events: %s", e)
                return
            tiers, held = found.tiers.tolist(), found.prefix_len
        if self.announcer is None:
            return
        seq = self.announcer.announce([event_hash_of(d) for d in digests], keys, prompt, tiers, held)
        st.kv_events_seq = -1 if seq is None else seq

    def _slice_where(self, keys: list[int]) -> list[int]:
        """Where the slice holds each block (a collective): the tiers that hold every host's shards
        of it (tpusync.kv.events.block_tier), 0 where a host lacks a part or its store failed."""
        assert self.slice is not None and self.store is not None
        per_host = self.host_shards[self.host_index]
        try:
            found = self.store.where([shard_key(k, n, self.shards) for k in keys for n in per_host]).tolist()
            mine = [block_tier(found[i * len(per_host):(i + 1) * len(per_host)]) for i in range(len(keys))]
        except errors.TpuSyncError as e:  # this host claims nothing; the collective goes on
            log.warning("could not look up this host's shards for KV events: %s", e)
            mine = [0] * len(keys)
        rows = self.slice.gather(np.array(mine, np.uint8))
        return [block_tier(rows[:, i].tolist()) for i in range(len(keys))]

    def _audit_loop(self, announcer: BlockAnnouncer, every_s: float) -> None:
        while True:
            time.sleep(every_s)  # a period, not a synchronisation: nothing waits on it
            store = self.store  # the current connection (a request may have opened a new one)
            assert store is not None
            try:
                announcer.audit(tiers_of(store))
            except errors.TpuSyncError as e:  # the sidecar is away: try again next period
                log.warning("KV events audit: %s", e)

    def _follow_loop(self, announcer: BlockAnnouncer, feed: KVStore) -> None:
        never = threading.Event()
        while True:
            try:
                follow(announcer, feed, never)
            except errors.TpuSyncError as e:  # the sidecar is away: the audit covers meanwhile
                log.warning("KV events feed: %s", e)
                never.wait(1.0)  # a back-off before the next long poll, not a synchronisation
                if self._reconnect is not None:  # a restarted sidecar: its feed on a new connection
                    try:
                        fresh = self._reconnect()
                    except errors.TpuSyncError as again:
                        log.warning("KV events feed: the sidecar is still away: %s", again)
                        continue
                    with contextlib.suppress(errors.TpuSyncError):
                        feed.close()
                    feed = fresh

    def _transfer_params(self, keys: list[int], request_id: str) -> dict[str, Any]:
        """The kv_transfer_params of a prefill (the contract's producer, vLLM's dialect): on a slice,
        each decode host pulls its shards from the host that holds them."""
        hosts = list(zip(self.slice_addresses, self.host_shards)) if self.slice is not None else None
        return handoff.producer_params(data_address=self.data_address, engine_id=self.engine_id, request_id=request_id,
                               num_tokens=len(keys) * self.cfg.page_size, block_size=self.cfg.page_size,
                               last_key=keys[-1] if keys else None, layout=self.layout,
                               hosts=[(a or None, h) for a, h in hosts] if hosts is not None else None)

    # -- gauges for /metrics ----------------------------------------------------------------

    def kv_cache_usage(self) -> float:
        return self.pages_in_use / self.cfg.pages

    def warm_up(self) -> None:
        """Compiles the shapes requests will use, so the first request's TTFT is not compile time."""
        span = self.cfg.chunk
        while True:
            forward(self.params, self.k, self.v, jnp.zeros(self.cfg.chunk, jnp.int32), jnp.int32(0), cfg=self.cfg,
                    n=self.cfg.chunk, span=span)
            self.k, self.v = self._empty_cache()
            forward(self.params, self.k, self.v, jnp.zeros(1, jnp.int32), jnp.int32(0), cfg=self.cfg, n=1, span=span)
            self.k, self.v = self._empty_cache()
            if span >= self.cfg.max_seq:
                break
            span = min(span * 2, self.cfg.max_seq)
        self.k, self.v = compile_loads([self.k, self.v], page_axis=KV_PAGE_AXIS)
        jax.block_until_ready(self.k)


@functools.cache
def _argmax_replicated(slice: Slice) -> Callable[[jax.Array, int], jax.Array]:
    """argmax of one row of logits, replicated on every process (a multi-process array converts
    to a number only then)."""
    return jax.jit(lambda logits, row: jnp.argmax(logits[row]), out_shardings=slice.sharding(None, 0))
