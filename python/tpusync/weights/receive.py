"""Receiving a version on one host, without a central executor.

Each destination host runs `receive_version` (or `python -m tpusync.weights receive`) against
its own sidecar, given the same model, version, sources, destinations and topology. The plan
is a pure function of those, so every host computes the same one and knows its parent in
each source's chain or tree. For each chunk, in the order every host uses, it waits until
its parent holds the chunk (asking the parent's sidecar), pulls it, checks it, and once all
are there it commits. Only the sidecars' authenticated data ports cross machines, so the
hosts can be anywhere; `WeightDistributor` is the one-machine variant that drives
every host's sidecar itself.

Sources are one host holding whole versions, or the hosts of a multi-process trainer in
process order (host i holds part i of n). The manifests come from the sources: a receiver
pulls the manifest reference (`manifest.ref_key`) and then the manifest it names.

A parent that cannot be reached, or that gains no chunk for `stall_seconds` (its own receiver
died, or never started), is routed around: the host pulls from that parent's parent, up to
the source. Start every host's receiver within `stall_seconds` of the others.

Every argument is checked before anything waits (`check_hosts`, `check_version`, and this
host's sidecar reaching `host`): a mistake is refused at once, not reported as a version that
was "not published in time" after the timeout.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tpusync import errors
from tpusync.store import KVStore
from tpusync.weights import land
from tpusync.weights import plan as planmod
from tpusync.weights.keys import Part, check_version, ref_key
from tpusync.weights.manifest import Manifest, merge_parts, source_chunks
from tpusync.weights.polling import backoff
from tpusync.weights.storage import commit_on_host, read_commit, read_manifest, write_manifest

ChunkCallback = Callable[[int, int, int], None]  # (chunks done, chunks total, bytes landed)


@dataclass
class ReceiveReport:
    model: str
    version: int
    host: str
    bytes: int
    chunks: int
    seconds: float = 0.0
    rerouted: list[tuple[str, str, str]] = field(default_factory=list)  # (source, dead parent, new parent)


def receive_version(store: KVStore, model: str, version: int, *, host: str, sources: Sequence[str],
                    destinations: Sequence[str], topology: str = planmod.CHAIN, fanout: int = 2,
                    chunk_blocks: int | None = None, verify: bool = True, timeout: float = 300.0,
                    stall_seconds: float = 30.0, on_chunk: ChunkCallback | None = None) -> ReceiveReport:
    """Lands `version` of `model` in this host's pool along the plan and commits it here.

    `host` is this host's data address as it appears in `destinations`. Raises
    InvalidArgumentError at once for arguments `check_hosts` or `check_version` refuses, or a
    `host` this host's sidecar cannot reach (every host dials the others by these addresses);
    DeadlineExceededError after `timeout`, UnavailableError when a source fails."""
    start = time.perf_counter()
    deadline = time.monotonic() + timeout
    version = check_version(version)
    host, sources, destinations = check_hosts(host, sources, destinations)
    _check_reachable(store, host, ref_key(model, version))
    n = len(sources)
    held = {s: _fetch_manifest(store, model, version, s, (i, n) if n > 1 else None, deadline)
            for i, s in enumerate(sources)}
    whole = merge_parts(list(held.values())) if n > 1 else held[sources[0]]
    chunks = source_chunks(held, chunk_blocks or whole.blocks_per_chunk)
    counts = {s: len(c) for s, c in chunks.items()}
    plan = planmod.build_plan(sources, destinations, chunks=counts, topology=topology, fanout=fanout)
    report = ReceiveReport(model, version, host, whole.nbytes, sum(counts.values()))
    dead: set[str] = set()
    order = planmod.chunk_order(counts)
    for done, (source, c) in enumerate(order, 1):
        keys = [b.key for b in chunks[source][c]]
        while True:
            up = planmod.live_parent(plan, source, host, dead)
            stall = deadline if up == source else min(deadline, time.monotonic() + stall_seconds)
            try:
                ok = _wait_held(store, up, keys, stall) and land.pull_chunk(store, up, chunks[source][c],
                                                                            whole.checksum, verify=verify)
            except errors.UnavailableError:
                ok = False
            if ok:
                break
            if up == source:
                if time.monotonic() >= deadline:
                    raise errors.DeadlineExceededError(f"chunk {c} of {source} did not arrive in {timeout} s")
                raise errors.UnavailableError(f"the source {source} failed to deliver chunk {c}")
            dead.add(up)
            report.rerouted.append((source, up, planmod.live_parent(plan, source, host, dead)))
        if on_chunk is not None:
            on_chunk(done, len(order), sum(b.length for b in chunks[source][c]))
    write_manifest(store, whole)
    commit_on_host(store, whole)
    report.seconds = time.perf_counter() - start
    return report


# host:port, the host a name or an IPv4 address, or an IPv6 address in brackets; the sidecars
# judge the rest (which names and addresses are members of the pool).
_ADDRESS = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})")


def check_hosts(host: str, sources: Sequence[str], destinations: Sequence[str], *,
                names: tuple[str, str, str] = ("host", "sources", "destinations")
                ) -> tuple[str, list[str], list[str]]:
    """(host, sources, destinations) without tpusync://, checked before anything waits; `names`
    are what a refusal calls the three (the CLI's flags). Every address is host:port, none is
    given twice (a source twice would be read as two parts of a multi-process trainer), and
    `host` is one of the destinations, not a source. InvalidArgumentError otherwise."""
    host_name, sources_name, destinations_name = names

    def addresses(what: str, given: Sequence[str]) -> list[str]:
        out: list[str] = []
        for a in (g.removeprefix("tpusync://") for g in given):
            port = _ADDRESS.fullmatch(a)
            if port is None or not 0 < int(port.group(1)) < 65536:
                raise errors.InvalidArgumentError(
                    f"{what} {a!r} is not host:port (port 1..65535; an IPv6 address in brackets: [fd00::1]:9400)")
            if a in out:
                raise errors.InvalidArgumentError(f"{what} {a} is given twice")
            out.append(a)
        if not out:
            raise errors.InvalidArgumentError(f"{what}: at least one address is needed")
        return out

    srcs = addresses(sources_name, sources)
    dsts = addresses(destinations_name, destinations)
    (me,) = addresses(host_name, [host])
    if me in srcs:
        raise errors.InvalidArgumentError(f"{host_name} {me} is one of the {sources_name}: a source holds the "
                                          "version already, it receives nothing")
    if me not in dsts:
        raise errors.InvalidArgumentError(f"{host_name} {me} is not one of the {destinations_name} {dsts}: "
                                          "it must be this host's address as the other hosts list it")
    return me, srcs, dsts


def _check_reachable(store: KVStore, host: str, key: int) -> None:
    """This host's sidecar reaches `host` as a pool member now: the other hosts pull from this one
    at that address, so an address no sidecar of the pool admits, or where none answers, is
    refused before the wait (nothing moves: one existence query)."""
    try:
        store.exists_remote(host, [key])
    except (errors.UnavailableError, errors.PreconditionError, errors.AuthError, errors.DeadlineExceededError) as e:
        raise errors.InvalidArgumentError(f"{host} (this host's address) cannot be reached from this host's "
                                          f"sidecar: {e}") from e


def _fetch_manifest(store: KVStore, model: str, version: int, source: str, part: Part | None,
                    deadline: float) -> Manifest:
    """The manifest (or part manifest) `source` publishes for `version`, waiting for it."""
    ref = ref_key(model, version, part)
    if not (_wait_held(store, source, [ref], deadline) and all(store.read_remote(source, [ref]))):
        what = f"part {part[0]} of {part[1]} of version" if part else "version"
        raise errors.DeadlineExceededError(f"{what} {version} of {model!r} was not published on {source} in time")
    record = read_commit(store, model, version, part, key=ref)
    if record is None or not all(store.read_remote(source, list(record.parts))):
        raise errors.UnavailableError(f"the manifest of version {version} of {model!r} left {source}")
    manifest = read_manifest(store, model, version, part, record=record)
    if manifest is None:
        raise errors.UnavailableError(f"the manifest of version {version} of {model!r} left this host's pool")
    return manifest


def _wait_held(store: KVStore, peer: str, keys: list[int], until: float) -> bool:
    """Polls the peer's sidecar until it holds every key (True), or `until` passes (False)."""
    pause = backoff()
    while not all(store.exists_remote(peer, keys)):
        if time.monotonic() >= until:
            return False
        pause()     # another host's pull in progress
    return True
