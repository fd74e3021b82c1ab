"""The messages between TPUSyncConnector's halves: what the scheduler asks of the workers each
step (TPUSyncConnectorMetadata: loads, saves, probes) and what the workers answer
(TPUSyncWorkerMetadata), with the worker's record of them (WorkerResults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from tpusync.engines.connector.common import Interval, TPUSyncStats


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
