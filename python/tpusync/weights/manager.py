"""WeightDistributor: registers work units and moves a version to every host once.

A work unit is a trainer or sampler process, placed on a host (one sidecar, one pool).
`start_transfer(src_units, dst_units)` reduces the units to hosts (one copy per host, however
many samplers it runs), computes the plan (`plan.build_plan`: a chain or a fan-out tree) and
runs it: each destination host pulls chunk c from its parent as soon as the parent holds it,
so every hop streams, with `in_flight` chunk pulls outstanding per host (each on its own
control channel, and the sidecar spreads concurrent pulls over its peer streams), so a hop's
link never idles through one chunk's request round trip or a late chunk upstream. Each chunk
is checked against the manifest's checksums when it lands; when all are there the executor
writes the manifest and commit record on that host, which commits (pins the version,
advances its head): samplers there never see a partial version.

A trainer spread over several hosts holds one part of each version per host: the sources
are then all of its hosts, each part streams over its own chain or tree (rotated, so the
parts' first hops land on different hosts), and each destination commits the merged
manifest (`manifest.merge_parts`, which refuses a version that misses a part).

A host that dies mid-transfer is routed around: hosts below it pull from its nearest live
ancestor (`plan.live_parent`), which already holds or is receiving the same chunks in order.

The executor drives each host's sidecar through its control socket, so it runs where those
sockets are: one machine. Across machines each destination host runs its own receiver on the
same plan (`tpusync.weights.receive`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tpusync import errors
from tpusync.store import KVStore
from tpusync.weights import land
from tpusync.weights import plan as planmod
from tpusync.weights.checksums import CHECKSUM
from tpusync.weights.head import read_head, read_part_head
from tpusync.weights.keys import check_version
from tpusync.weights.manifest import BlockRef, Manifest, merge_parts, source_chunks
from tpusync.weights.storage import commit_on_host, read_manifest, write_manifest

TRAINER = "trainer"
SAMPLER = "sampler"


@dataclass(frozen=True)
class WorkUnit:
    name: str
    host: str                    # the host sidecar's data address, "host:port"
    control_socket: str | None   # that sidecar's control socket (for the executor)
    role: str = SAMPLER


@dataclass
class TransferReport:
    model: str
    version: int
    bytes: int
    chunks: int
    plan: planmod.Plan
    seconds: float = 0.0
    committed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    rerouted: list[tuple[str, str, str]] = field(default_factory=list)  # (host, dead parent, new parent)

    @property
    def ok(self) -> bool:
        return not self.failed


ChunkCallback = Callable[[str, int, int, int], None]  # (host, chunks done, chunks total, bytes landed)


class _HostDead(Exception):
    pass


class WeightDistributor:
    """Computes transfer plans from registered work units and runs them."""

    def __init__(self, *, topology: str = planmod.CHAIN, fanout: int = 2, verify: bool = True,
                 timeout: float = 300.0, chunk_blocks: int | None = None, in_flight: int = 2):
        if in_flight < 1:
            raise errors.InvalidArgumentError(f"in_flight must be at least 1, not {in_flight}")
        self.topology = topology
        self.fanout = fanout
        self.verify = verify
        self.timeout = timeout
        self.chunk_blocks = chunk_blocks
        self.in_flight = in_flight
        self._units: dict[str, WorkUnit] = {}
        self._stores: dict[tuple[str, int], KVStore] = {}  # (host, channel): one request at a time each
        self._lock = threading.Lock()
        self._runner = ThreadPoolExecutor(2, thread_name_prefix="tpusync-weights-transfer")
        self._metrics: dict[str, Any] = {"transfers": 0, "transfers_failed_hosts": 0, "bytes_moved": 0,
                                         "reroutes": 0, "last_transfer_seconds": 0.0, "last_version": None}

    # -- registry ---------------------------------------------------------------------------

    def register_work_unit(self, name: str, *, host: str, control_socket: str | None = None,
                           role: str = SAMPLER) -> WorkUnit:
        """Adds (or replaces, on restart) a unit: a trainer or sampler on the host at `host`."""
        if role not in (TRAINER, SAMPLER):
            raise errors.InvalidArgumentError(f"role must be {TRAINER!r} or {SAMPLER!r}, not {role!r}")
        unit = WorkUnit(name, host.removeprefix("tpusync://"), control_socket, role)
        with self._lock:
            self._units[name] = unit
        return unit

    def unregister_work_unit(self, name: str) -> None:
        with self._lock:
            self._units.pop(name, None)

    def units(self, role: str | None = None) -> list[WorkUnit]:
        with self._lock:
            return [u for u in self._units.values() if role is None or u.role == role]

    def _resolve(self, units: Iterable[str | WorkUnit] | None, role: str) -> list[WorkUnit]:
        if units is None:
            return self.units(role)
        out = []
        with self._lock:
            for u in units:
                if isinstance(u, WorkUnit):
                    out.append(u)
                elif u in self._units:
                    out.append(self._units[u])
                else:
                    raise errors.NotFoundError(f"work unit {u!r} is not registered")
        return out

    def _store(self, unit: WorkUnit, channel: int = 0) -> KVStore:
        with self._lock:
            store = self._stores.get((unit.host, channel))
            if store is None:
                if unit.control_socket is None:
                    raise errors.PreconditionError(f"host {unit.host} ({unit.name}) has no control socket registered")
                store = self._stores[unit.host, channel] = KVStore.connect(f"unix://{unit.control_socket}")
            return store

    def _forget(self, host: str, channel: int | None = None) -> None:
        """Drops the host's control channels (one of them with `channel`); the next use reconnects."""
        with self._lock:
            for key in [k for k in self._stores if k[0] == host and channel in (None, k[1])]:
                del self._stores[key]

    # -- planning ---------------------------------------------------------------------------

    def plan(self, src_units: Sequence[str | WorkUnit] | None, dst_units: Sequence[str | WorkUnit] | None,
             chunks: int) -> planmod.Plan:
        """The plan over the units' hosts: one copy per host, sources excluded."""
        src = self._resolve(src_units, TRAINER)
        dst = self._resolve(dst_units, SAMPLER)
        return planmod.build_plan([u.host for u in src], [u.host for u in dst], chunks=chunks,
                                  topology=self.topology, fanout=self.fanout)

    # -- running ----------------------------------------------------------------------------

    def start_transfer(self, src_units: Sequence[str | WorkUnit] | None, dst_units: Sequence[str | WorkUnit] | None,
                       model: str, version: int | None = None, *,
                       on_chunk: ChunkCallback | None = None) -> Future[TransferReport]:
        """Sends a committed version (default: the sources' current one) to every destination
        host. The sources are one trainer host holding whole versions, or every host of a
        multi-process trainer, each holding its part: then each part streams over its own
        chain or tree and every destination commits the merged version. The future's result
        is a TransferReport; hosts that died are in `report.failed`, the others committed.
        It raises if a source cannot be read or the parts do not make a whole version."""
        if version is not None:
            version = check_version(version)
        src = self._resolve(src_units, TRAINER)
        dst = self._resolve(dst_units, SAMPLER)
        if not src:
            raise errors.InvalidArgumentError("start_transfer needs at least one source unit")
        src = list({u.host: u for u in src}.values())   # one copy per host: one unit per source host
        return self._runner.submit(self._run, src, dst, model, version, on_chunk)

    def transfer(self, *args: Any, **kw: Any) -> TransferReport:
        """start_transfer(...).result()."""
        return self.start_transfer(*args, **kw).result()

    def _source_manifests(self, src: list[WorkUnit], model: str,
                          version: int | None) -> tuple[int, dict[str, Manifest], Manifest]:
        """The version to send, what each source host holds of it, and the whole manifest."""
        stores = {u.host: self._store(u) for u in src}
        parts = {u.host: read_part_head(stores[u.host].pool_path, model) for u in src}
        if len(src) == 1 and (parts[src[0].host] is None
                              or read_head(stores[src[0].host].pool_path, model) is not None):
            host = src[0].host
            if version is None:
                version = read_head(stores[host].pool_path, model)
                if version is None:
                    raise errors.NotFoundError(f"no committed version of {model!r} on {host}")
            manifest = read_manifest(stores[host], model, version)
            if manifest is None:
                raise errors.NotFoundError(f"version {version} of {model!r} is not committed on {host}")
            return version, {host: manifest}, manifest
        found = {h: p for h, p in parts.items() if p is not None}
        missing = [h for h in parts if h not in found]
        if missing:
            raise errors.NotFoundError(f"no published part of {model!r} on {', '.join(missing)}")
        if version is None:
            version = min(v for v, _ in found.values())    # the newest version every part host has
        count = {p[1] for _, p in found.values()}
        indexes = sorted(p[0] for _, p in found.values())
        if len(count) != 1 or indexes != list(range(count.pop())):
            got = ", ".join(f"{h}: part {p[0]} of {p[1]}" for h, (_, p) in found.items())
            raise errors.InvalidArgumentError(f"the sources must be every trainer host of one layout, "
                                              f"each holding one part of {model!r}; got {got}")
        held = {}
        for u in src:
            part = found[u.host][1]
            m = read_manifest(stores[u.host], model, version, part)
            if m is None:
                raise errors.NotFoundError(f"part {part[0]} of {part[1]} of version {version} of {model!r} "
                                           f"is not committed on {u.host}")
            held[u.host] = m
        return version, held, merge_parts(list(held.values()))

    def _run(self, src: list[WorkUnit], dst: list[WorkUnit], model: str, version: int | None,
             on_chunk: ChunkCallback | None) -> TransferReport:
        start = time.perf_counter()
        version, held, whole = self._source_manifests(src, model, version)
        chunks = source_chunks(held, self.chunk_blocks or whole.blocks_per_chunk)
        counts = {h: len(c) for h, c in chunks.items()}
        plan = planmod.build_plan(list(held), [u.host for u in dst], chunks=counts, topology=self.topology,
                                  fanout=self.fanout)
        order = planmod.chunk_order(counts)
        report = TransferReport(model, version, whole.nbytes, len(order), plan)
        by_host = {u.host: u for u in dst}
        state = _State(plan, whole.checksum)
        deadline = time.monotonic() + self.timeout

        def pull_chunks(host: str, channel: int) -> None:
            """Lands the host's next unclaimed chunks, in order, until none is left or the host is out."""
            while True:
                with state.cond:
                    if host in state.stopped or state.claimed[host] == len(order):
                        return
                    source, c = order[state.claimed[host]]
                    state.claimed[host] += 1
                try:
                    if not self._land_chunk(state, report, by_host[host], source, c, chunks[source][c], deadline,
                                            channel):
                        return
                except BaseException:
                    with state.cond:  # the host is out: its other channels stop
                        state.stopped.add(host)
                        state.cond.notify_all()
                    raise
                with state.cond:
                    state.done[host] += 1
                    done = state.done[host]
                if on_chunk is not None:
                    on_chunk(host, done, len(order), sum(b.length for b in chunks[source][c]))

        def run_host(host: str) -> None:
            try:
                with ThreadPoolExecutor(self.in_flight, thread_name_prefix="tpusync-weights-pull") as pool:
                    pulls = [pool.submit(pull_chunks, host, k) for k in range(self.in_flight)]
                for p in pulls:
                    p.result()
                # Everything is here: the whole version's manifest, then its commit record.
                store = self._store(by_host[host])
                write_manifest(store, whole)
                commit_on_host(store, whole)
                with state.cond:
                    report.committed.append(host)
            except Exception as e:  # noqa: BLE001 - the host is out of this transfer; others go on
                self._forget(host)
                with state.cond:
                    report.failed[host] = f"{type(e).__name__}: {e}"
                    state.route_around(host, report)

        hosts = list(plan.destinations)
        if hosts:
            with ThreadPoolExecutor(len(hosts), thread_name_prefix="tpusync-weights-hop") as pool:
                list(pool.map(run_host, hosts))
        report.seconds = time.perf_counter() - start
        with self._lock:
            self._metrics["transfers"] += 1
            self._metrics["transfers_failed_hosts"] += len(report.failed)
            self._metrics["bytes_moved"] += report.bytes * len(report.committed)
            self._metrics["reroutes"] += len(report.rerouted)
            self._metrics["last_transfer_seconds"] = report.seconds
            self._metrics["last_version"] = version
        failed_sources = [h for h in plan.sources if h in state.dead]
        if hosts and not report.committed and failed_sources:
            raise errors.UnavailableError(f"source {', '.join(failed_sources)} failed: {report.failed}")
        return report

    def _land_chunk(self, state: _State, report: TransferReport, unit: WorkUnit, source: str, c: int,
                    blocks: list[BlockRef], deadline: float, channel: int) -> bool:
        """Pulls chunk c of `source` from this host's live parent in that source's tree, over
        the host's control channel `channel`; False when the host stopped meanwhile."""
        host = unit.host
        while True:
            store = self._store(unit, channel)
            with state.cond:
                while True:
                    if host in state.stopped:
                        return False
                    up = state.parent(source, host)
                    if state.ready[source][up] > c:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise errors.DeadlineExceededError(f"chunk {c} of {source} did not reach {up} in time")
                    state.cond.wait(left)
            try:
                ok = land.pull_chunk(store, up, blocks, state.checksum, verify=self.verify)
            except errors.TpuSyncError:  # refused, reset, cut mid-handshake: the peer or we are gone
                ok = False
            if ok:
                break
            self._forget(host, channel)  # a control channel closes after a failed request: reconnect
            self._check_alive(unit)
            with state.cond:
                if up == source:
                    state.dead.add(up)
                    state.cond.notify_all()
                    raise errors.UnavailableError(f"the source {up} failed to deliver chunk {c}")
                report.failed.setdefault(up, f"unreachable from {host} at chunk {c} of {source}")
                state.route_around(up, report)  # the relay failed us
        with state.cond:
            state.landed_chunks[source][host].add(c)
            held = state.landed_chunks[source][host]
            while state.ready[source][host] in held:  # children pull from the host's whole prefix
                state.ready[source][host] += 1
            state.cond.notify_all()
        return True

    def _check_alive(self, unit: WorkUnit) -> None:
        try:
            self._store(unit).stats()
        except errors.TpuSyncError as e:
            self._forget(unit.host)
            raise _HostDead(f"{unit.host}'s own sidecar is gone: {e}") from e

    # -- metrics ----------------------------------------------------------------------------

    def get_metrics(self) -> dict[str, Any]:
        """Transfer counters, and each known host's pool occupancy and traffic from its sidecar."""
        with self._lock:
            out = dict(self._metrics)
            stores = dict(self._stores)
        hosts = {}
        for host, store in stores.items():
            try:
                hosts[host] = store.stats()
            except errors.TpuSyncError as e:
                hosts[host] = {"error": str(e)}
        out["hosts"] = hosts
        return out

    def close(self) -> None:
        self._runner.shutdown(wait=True)
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for s in stores:
            s.close()

    def __enter__(self) -> WeightDistributor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _State:
    """Which chunks of each source each host holds, who is dead, and each destination's
    progress through the chunk order; guarded by `cond`."""

    def __init__(self, plan: planmod.Plan, checksum: str = CHECKSUM):
        self.plan = plan
        self.checksum = checksum
        self.cond = threading.Condition()
        # ready[source][host]: the chunks of `source` the host holds all of, from the first.
        self.ready = {s: {**dict.fromkeys(plan.destinations, 0), s: plan.chunks[s]} for s in plan.sources}
        self.landed_chunks: dict[str, dict[str, set[int]]] = {
            s: {h: set() for h in plan.destinations} for s in plan.sources}
        self.dead: set[str] = set()      # hosts routed around
        self.stopped: set[str] = set()   # destinations whose own pulls failed: their channels stop
        self.claimed = dict.fromkeys(plan.destinations, 0)  # next chunk (index into the order) per host
        self.done = dict.fromkeys(plan.destinations, 0)     # chunks landed per host

    def parent(self, source: str, host: str) -> str:
        return planmod.live_parent(self.plan, source, host, self.dead)

    def route_around(self, host: str, report: TransferReport) -> None:
        """`host` is out of the transfer: every destination still pulling from it in a source's
        tree moves to its next live ancestor, recorded once per (destination, dead parent),
        whether a pull of its own failed first or the host's own transfer did."""
        children = [(s, d) for s in self.plan.sources for d in self.plan.destinations
                    if d not in self.dead and d not in report.committed and self.parent(s, d) == host]
        self.dead.add(host)
        for source, child in children:
            if not any(r[:2] == (child, host) for r in report.rerouted):
                report.rerouted.append((child, host, self.parent(source, child)))
        self.cond.notify_all()
