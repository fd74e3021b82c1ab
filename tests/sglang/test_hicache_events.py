"""KV events for the pages tpusync stores for SGLang, as llm-d's own indexer (v0.9.0,
tests/llmd/indexer) reads them from the pod's one endpoint: SGLang's own events, made by SGLang's
own recorder (sglang/srt/mem_cache/events.py, `KVCacheEventRecorder`) from SGLang's radix nodes
and published by SGLang's own `ZmqEventPublisher`, relayed with the backend's.

The pages' storage keys are SGLang's (`get_storage_hash_str`, the keys its cache controller
hands the backend); sidecars are real tpusync-sidecar processes."""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from sglang.srt.disaggregation.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
from sglang.srt.mem_cache.utils import get_storage_hash_str

from harness.llmd_indexer import MODEL, Indexer, indexer_binary
from harness.polling import wait_for
from harness.sglang_pools import PAGE, make_backend, make_pool
from tests.sglang.conftest import fill
from tpusync import KVStore, errors
from tpusync.engines.sglang.events import page_hash, part_keys

POD = "127.0.0.1:30000"  # the pod llm-d scores; nothing listens there
TOPIC = f"kv@{POD}@{MODEL}"  # the served model name llm-d hashes in (Indexer.score asks for it)


class Engine:
    """SGLang's side of a pod: its publisher (bound where the backend's relay reaches it) and
    radix nodes whose stores and removals its recorder turns into events."""

    def __init__(self, work: Path) -> None:
        self.endpoint = f"ipc://{work}/sglang-events"
        self.publisher = ZmqEventPublisher(0, endpoint=self.endpoint, topic=TOPIC)
        self.recorder = KVCacheEventRecorder(enabled=True, page_size=PAGE)
        self.root = TreeNode()
        self.root.key, self.root.hash_value = RadixKey([]), []

    def node(self, tokens: list[int]) -> Any:
        node = TreeNode()
        node.parent, node.key = self.root, RadixKey(list(tokens))
        return node

    def publish(self, *events: Any) -> None:
        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events) or self.recorder.take()))

    def stored(self, node: Any) -> list[str]:
        """SGLang's device cache took the node's pages: its own BlockStored; returns their storage keys."""
        self.recorder.record_store(node)
        self.publish()
        return list(node.hash_value)

    def close(self) -> None:
        self.publisher.shutdown()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


@pytest.fixture
def sockets():
    """A short directory for ipc:// endpoints (a socket path has at most 107 bytes; pytest's are longer)."""
    with tempfile.TemporaryDirectory(prefix="tpusync-sgl-") as d:
        yield Path(d)


@pytest.fixture
def pod(sockets: Path, launch):
    """A sidecar, SGLang's publisher, the pod endpoint the backend's relay binds, and llm-d's
    indexer (subscribed by `subscribed`)."""
    host = launch("events")
    engine = Engine(sockets)
    ix = Indexer(indexer_binary(), PAGE)
    events = {"endpoint": f"ipc://{sockets}/pod", "engine_endpoint": engine.endpoint, "topic": TOPIC}
    yield host, engine, ix, events
    ix.stop()
    engine.close()


@pytest.fixture
def backend(pod):
    """The pod's backend (rank 0 of one) on a page_first host pool, llm-d subscribed to its relay."""
    host, engine, ix, events = pod
    pool = make_pool("page_first")
    storage = make_backend(pool, {"control_socket": host.socket, "kv_events": events})
    try:
        subscribed(ix, engine, events["endpoint"])
        yield pool, storage
    finally:
        storage.close()


def backed_up(pod, backend, pages: int, seed: int) -> tuple[list[int], list[str]]:
    """A prompt SGLang's device cache took and the backend backed up: in the index on both tiers.
    Returns the prompt and its pages' storage keys."""
    _, engine, ix, _ = pod
    pool, storage = backend
    prompt = tokens(pages * PAGE, seed=seed)
    keys = engine.stored(engine.node(prompt))
    assert storage.batch_set_v1(keys, fill(pool, pages)) == [True] * pages
    until(ix, prompt, {"gpu": pages, "cpu": pages})
    return prompt, keys


def tiers(ix: Indexer, prompt: list[int]) -> dict[str, int]:
    return ix.tiers(prompt, POD)


def until(ix: Indexer, prompt: list[int], want: dict[str, int]) -> None:
    wait_for(f"llm-d's index to hold {want}", lambda: tiers(ix, prompt) == want, 30, interval=0.05,
             on_timeout=lambda: f"it holds {tiers(ix, prompt)}")


def subscribed(ix: Indexer, engine: Engine, endpoint: str) -> None:
    """Subscribes llm-d; a PUB drops what it sends before a subscription arrives, so SGLang's probe
    stores are published until one is in the index."""
    ix.subscribe(POD, endpoint)
    probe = tokens(2 * PAGE, seed=999)
    wait_for("llm-d to receive SGLang's events through the relay", lambda: tiers(ix, probe), 30, interval=0.1,
             step=lambda: engine.stored(engine.node(probe)))


def marker(ix: Indexer, engine: Engine, seed: int) -> None:
    """Waits until an event of SGLang's published now is in the index: what the relay sent before is too."""
    probe = tokens(PAGE, seed)
    engine.stored(engine.node(probe))
    until(ix, probe, {"gpu": 1})


def test_sglangs_storage_keys_are_the_hashes_its_events_carry(pod):
    _, engine, _, _ = pod
    prompt = tokens(6 * PAGE, seed=1)
    node = engine.node(prompt)
    engine.recorder.record_store(node)
    stored = engine.recorder.take()
    assert node.hash_value == get_storage_hash_str(RadixKey(prompt), None, page_size=PAGE)
    assert [h for e in stored for h in e.block_hashes] == [page_hash(k) for k in node.hash_value]


def test_pages_in_the_sidecar_reach_llmd_and_leave_it_with_the_sidecar(pod, backend):
    host, engine, ix, _ = pod
    pool, storage = backend
    prompt = tokens(6 * PAGE, seed=2)
    node = engine.node(prompt)
    keys = engine.stored(node)
    until(ix, prompt, {"gpu": 6})

    assert storage.batch_set_v1(keys, fill(pool, 6)) == [True] * 6
    until(ix, prompt, {"gpu": 6, "cpu": 6})

    # SGLang evicts the node from the device: the pod still serves the prefix from L3.
    engine.recorder.record_remove(node)
    engine.publish()
    until(ix, prompt, {"cpu": 6})

    # The sidecar evicts the last three pages (no disk tier: gone): its change feed tells llm-d.
    parts = part_keys(storage._scope, keys[3:], storage._plan.slots)
    with KVStore.connect(f"unix://{host.socket}") as store:
        store.evict([k for p in parts for k in p])
    until(ix, prompt, {"cpu": 3})

    # SGLang computes the prefix again (its own events map the pages again: llm-d forgot the
    # evicted ones with their last tier) and backs it up: every page is announced again. As at
    # the start, the backup follows the engine's events into the index: the two streams are not
    # ordered with each other, and llm-d drops a tier event of a page it has not mapped yet (in
    # SGLang the write-back follows the step's events by the host copy's time).
    engine.stored(node)
    until(ix, prompt, {"gpu": 6, "cpu": 3})
    assert storage.batch_set_v1(keys, fill(pool, 6, seed=3)) == [True] * 6
    until(ix, prompt, {"gpu": 6, "cpu": 6})


def test_a_page_is_announced_once_every_tp_rank_stored_its_heads(pod):
    host, engine, ix, events = pod
    pool0, pool1 = make_pool("page_first"), make_pool("page_first")
    rank0 = make_backend(pool0, {"control_socket": host.socket, "kv_events": events}, tp_rank=0, tp_size=2)
    # The same settings on every rank, as SGLang passes them: only rank 0 binds the pod's endpoint.
    rank1 = make_backend(pool1, {"control_socket": host.socket, "kv_events": events}, tp_rank=1, tp_size=2)
    try:
        assert rank1._events is None
        subscribed(ix, engine, events["endpoint"])
        prompt = tokens(4 * PAGE, seed=4)
        keys = engine.stored(engine.node(prompt))
        until(ix, prompt, {"gpu": 4})

        assert rank0.batch_set_v1(keys, fill(pool0, 4)) == [True] * 4
        marker(ix, engine, seed=5)
        assert tiers(ix, prompt) == {"gpu": 4}, "announced before rank 1 stored its heads"

        assert rank1.batch_set_v1(keys[:2], fill(pool1, 2)) == [True] * 2  # the feed reports rank 1's puts
        until(ix, prompt, {"gpu": 4, "cpu": 2})
        assert rank1.batch_set_v1(keys[2:], fill(pool1, 2)) == [True] * 2
        until(ix, prompt, {"gpu": 4, "cpu": 4})
    finally:
        rank0.close()
        rank1.close()


def test_after_sglang_clears_its_cache_the_stored_pages_are_announced_again(pod, backend):
    """SGLang's /flush_cache publishes AllBlocksCleared, which makes llm-d forget every tier of the
    pod; what the sidecar still holds is announced again, so the router keeps the L3 prefix."""
    _, engine, ix, _ = pod
    prompt, _ = backed_up(pod, backend, 5, seed=6)
    engine.publish(AllBlocksCleared())
    until(ix, prompt, {"cpu": 5})


def test_llmds_sglang_adapter_cannot_read_sglang_0_5_23s_events():
    """SGLang 0.5.23 encodes events as tagged maps (`KVCacheEvent`: tag=True, no array_like);
    llm-d v0.9.0's "sglang" engine adapter reads positional arrays only
    (pkg/kvevents/engineadapter/sglang_adapter.go), its default vLLM adapter reads both. So an
    EndpointPickerConfig for SGLang pods leaves kvEventsConfig.engineType unset (docs/sglang.md).
    One stream: positional batches (which the sglang adapter reads) around one of SGLang's own."""
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:0")
    seq = iter(range(1 << 30))

    def send(payload: bytes) -> None:
        pub.send_multipart([TOPIC.encode(), next(seq).to_bytes(8, "big"), payload])

    def positional(prompt: list[int], first_hash: int) -> bytes:
        # 64-bit hashes, as engines send: llm-d reads a hash msgpack packs small as no hash at all
        hashes = [(first_hash << 40) + i for i in range(len(prompt) // PAGE)]
        return msgspec.msgpack.encode([time.time(), [["BlockStored", hashes, None, prompt, PAGE, None, "GPU"]], 0])

    adapters = {name: Indexer(indexer_binary(), PAGE, engine_type=name) for name in ("sglang", "vllm")}
    try:
        for ix in adapters.values():
            ix.subscribe(POD, pub.getsockopt_string(zmq.LAST_ENDPOINT))
        probe, theirs, after = tokens(2 * PAGE, seed=7), tokens(2 * PAGE, seed=8), tokens(2 * PAGE, seed=9)
        for ix in adapters.values():
            wait_for("the adapters to read positional batches", lambda ix=ix: tiers(ix, probe), 30, interval=0.1,
                     step=lambda: send(positional(probe, 1)))
        engine = Engine.__new__(Engine)  # SGLang's recorder and nodes, without a publisher of its own
        engine.recorder = KVCacheEventRecorder(enabled=True, page_size=PAGE)
        engine.root = TreeNode()
        engine.root.key, engine.root.hash_value = RadixKey([]), []
        engine.recorder.record_store(engine.node(theirs))
        send(msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=engine.recorder.take())))
        send(positional(after, 2))
        for ix in adapters.values():
            until(ix, after, {"gpu": 2})
        assert tiers(adapters["vllm"], theirs) == {"gpu": 2}
        assert tiers(adapters["sglang"], theirs) == {}
    finally:
        for ix in adapters.values():
            ix.stop()
        pub.close(linger=0)


@pytest.mark.parametrize(("events", "field"), [
    ({"endpoint": "ipc:///tmp/x", "engine_endpoint": "ipc:///tmp/y"}, "topic"),
    ({"endpoint": "ipc:///tmp/x", "engine_endpoint": "ipc:///tmp/y", "topic": "t", "extra": 1}, "extra"),
    ({"endpoint": "ipc:///tmp/x", "engine_endpoint": "tcp://collector:5557", "topic": TOPIC},
     "kv_events.engine_endpoint"),
    ({"endpoint": "ipc:///tmp/x", "engine_endpoint": "ipc:///tmp/y", "topic": "pod-a"}, "kv_events.topic"),
    ("tcp://*:5557", "kv_events"),
])
def test_bad_kv_events_settings_fail_sglangs_start_with_their_name(launch, events, field):
    host = launch("bad")
    with pytest.raises(errors.InvalidArgumentError, match=field):
        make_backend(make_pool("page_first"), {"control_socket": host.socket, "kv_events": events})


def test_kv_events_need_the_sidecar_and_one_pipeline_stage(launch, sockets):
    host = launch("pp")
    events = {"endpoint": f"ipc://{sockets}/p", "engine_endpoint": f"ipc://{sockets}/e", "topic": TOPIC}
    with pytest.raises(errors.InvalidArgumentError, match="store_url"):
        make_backend(make_pool("page_first"), {"store_url": "tpusync://127.0.0.1:1", "kv_events": events})
    with pytest.raises(errors.InvalidArgumentError, match="pp_size 2"):
        make_backend(make_pool("page_first"), {"control_socket": host.socket, "kv_events": events}, pp_size=2)


def test_the_feed_follows_a_restarted_sidecar(pod, backend, launch):
    """The sidecar restarts (its shared-memory pool and the pages in it survive): the backend's feed
    dials it again, and what the new sidecar evicts still reaches the router."""
    host, _, ix, _ = pod
    _, storage = backend
    prompt, keys = backed_up(pod, backend, 4, seed=10)
    assert host.sidecar.stop() == 0
    again = launch("events")
    parts = [k for page in part_keys(storage._scope, keys, storage._plan.slots) for k in page]  # page-major
    with KVStore.connect(f"unix://{again.socket}") as store:
        assert store.lookup(parts).prefix_len == len(parts)
        store.evict(parts[len(parts) // 2:])  # the last two pages
    until(ix, prompt, {"gpu": 4, "cpu": 2})
