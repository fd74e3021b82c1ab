"""The transfer plan: who pulls which chunk from whom. Pure functions, no I/O.

Weights travel host to host once. Every destination host has one upstream (its parent)
for each source; a chunk moves over an edge as soon as the parent holds it, so a chain of
hosts streams: while host 2 pulls chunk c from host 1, host 1 pulls chunk c+1 from the
source. A tree with fan-out K trades depth (log_K hosts instead of hosts) for K copies on
each relay's uplink.

With several source hosts (a sharded trainer: each host publishes its own shards), each
source gets its own chain/tree over the destinations, rotated so that different sources
enter the destination set at different hosts and no single link carries everything first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

CHAIN = "chain"
TREE = "tree"


@dataclass(frozen=True)
class Plan:
    """parents[source][host] = the host it pulls that source's chunks from.

    `chunks[source]` is how many chunks that source contributes. Hosts are opaque strings
    (data addresses).
    """

    sources: tuple[str, ...]
    destinations: tuple[str, ...]
    parents: dict[str, dict[str, str]]
    chunks: dict[str, int]
    topology: str = CHAIN
    fanout: int = 1
    dead: frozenset[str] = field(default_factory=frozenset)

    def parent(self, source: str, host: str) -> str:
        return self.parents[source][host]

    def children(self, source: str, host: str) -> list[str]:
        return [h for h, p in self.parents[source].items() if p == host]

    def path(self, source: str, host: str) -> list[str]:
        """The hosts a chunk passes through from the source to `host`, both included."""
        out = [host]
        while out[-1] != source:
            out.append(self.parents[source][out[-1]])
            if len(out) > len(self.destinations) + 1:
                raise ValueError(f"plan has a cycle through {host}")
        return out[::-1]

    def depth(self, source: str) -> int:
        return max((len(self.path(source, h)) - 1 for h in self.parents[source]), default=0)

    def max_fanout(self) -> int:
        worst = 0
        for parents in self.parents.values():
            counts: dict[str, int] = {}
            for p in parents.values():
                counts[p] = counts.get(p, 0) + 1
            worst = max([worst, *counts.values()])
        return worst


def build_plan(sources: Sequence[str], destinations: Sequence[str], *, chunks: int | dict[str, int],
               topology: str = CHAIN, fanout: int = 2) -> Plan:
    """Computes the plan for sending every source's chunks to every destination host.

    Hosts that are also sources are dropped from the destinations (they hold their own
    chunks already); duplicates are ignored; order is kept, so callers control who is near
    the source. `fanout` applies to trees (a chain has fan-out 1).
    """
    if not sources:
        raise ValueError("a plan needs at least one source host")
    if topology not in (CHAIN, TREE):
        raise ValueError(f"topology must be {CHAIN!r} or {TREE!r}, not {topology!r}")
    if topology == TREE and fanout < 1:
        raise ValueError("fanout must be at least 1")
    sources = tuple(dict.fromkeys(sources))
    dests = tuple(h for h in dict.fromkeys(destinations) if h not in sources)
    chunk_counts = dict.fromkeys(sources, chunks) if isinstance(chunks, int) else {s: chunks[s] for s in sources}
    if any(n < 1 for n in chunk_counts.values()):
        raise ValueError("every source needs at least one chunk")
    k = 1 if topology == CHAIN else fanout
    parents: dict[str, dict[str, str]] = {}
    for i, source in enumerate(sources):
        # Rotate the destination order per source so several sources spread their first hops.
        shift = (i * len(dests)) // len(sources) if dests else 0
        order = dests[shift:] + dests[:shift]
        parents[source] = _kary(source, order, k)
    return Plan(sources, dests, parents, chunk_counts, topology, k)


def live_parent(plan: Plan, source: str, host: str, dead: Iterable[str]) -> str:
    """Where `host` pulls `source`'s chunks from once `dead` hosts are out: its nearest live
    ancestor in that source's tree (the source itself at worst)."""
    p = plan.parent(source, host)
    while p in dead and p != source:
        p = plan.parent(source, p)
    return p


def chunk_order(chunks: dict[str, int]) -> list[tuple[str, int]]:
    """The order a destination takes (source, chunk) in: the sources in turns, so several
    sources' streams run side by side."""
    return [(s, c) for c in range(max(chunks.values(), default=0)) for s in chunks if c < chunks[s]]


def _kary(root: str, order: Sequence[str], k: int) -> dict[str, str]:
    """A complete k-ary tree in breadth-first order; k=1 is a chain."""
    nodes = [root, *order]
    return {nodes[i]: nodes[(i - 1) // k] for i in range(1, len(nodes))}


def reroute(plan: Plan, dead: Iterable[str]) -> Plan:
    """The plan with dead hosts removed: each orphan pulls from its nearest live ancestor.

    A dead source cannot be routed around (its chunks exist nowhere else) and raises.
    The new parent of a host is the first live host on its old path to the source, which
    already holds (or is receiving, in stream order) the same chunks.
    """
    dead = frozenset(dead) | plan.dead
    for source in plan.sources:
        if source in dead:
            raise ValueError(f"source host {source} is dead: its chunks have no other copy")
    parents = {source: {host: live_parent(plan, source, host, dead)
                        for host in plan.parents[source] if host not in dead}
               for source in plan.sources}
    dests = tuple(h for h in plan.destinations if h not in dead)
    return Plan(plan.sources, dests, parents, plan.chunks, plan.topology, plan.fanout, dead)


@dataclass(frozen=True)
class Prediction:
    seconds: float
    naive_seconds: float
    depth: int
    link_copies: int  # copies of the weights leaving the busiest host


def predict(total_bytes: int, hosts: int, *, link_bytes_per_s: float, chunk_bytes: int,
            topology: str = CHAIN, fanout: int = 2) -> Prediction:
    """Time to reach `hosts` destination hosts from one source, links being the limit.

    A pipelined tree of depth d with fan-out k: each relay's uplink carries k copies, so the
    stream runs at link/k and the last chunk arrives d chunk-hops after the first:
        T = k * (bytes + (d - 1) * chunk) / link
    (a chain is k = 1, d = hosts). The naive plan sends every host its own copy from the
    source: T = hosts * bytes / link.
    """
    if hosts < 1:
        return Prediction(0.0, 0.0, 0, 0)
    k = 1 if topology == CHAIN else max(1, fanout)
    depth = tree_depth(hosts, k)
    k_eff = min(k, hosts)
    chunk = min(chunk_bytes, total_bytes)
    seconds = k_eff * (total_bytes + (depth - 1) * chunk) / link_bytes_per_s
    return Prediction(seconds, hosts * total_bytes / link_bytes_per_s, depth, k_eff)


def chunk_ranges(n_blocks: int, blocks_per_chunk: int) -> list[range]:
    """Consecutive block index ranges, one per chunk (the last may be short)."""
    if blocks_per_chunk < 1:
        raise ValueError("blocks_per_chunk must be at least 1")
    return [range(i, min(i + blocks_per_chunk, n_blocks)) for i in range(0, n_blocks, blocks_per_chunk)]


def tree_depth(hosts: int, fanout: int) -> int:
    """Depth of a complete fan-out tree over `hosts` destinations below the source."""
    if hosts <= 0:
        return 0
    if fanout == 1:
        return hosts
    depth, reach, level = 0, 0, 1
    while reach < hosts:
        level *= fanout
        reach += level
        depth += 1
    return depth
