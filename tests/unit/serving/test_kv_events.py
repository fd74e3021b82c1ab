"""KV events in vLLM's format, received by a real ZMQ SUB socket."""

from __future__ import annotations

import struct
import threading
from array import array

import msgpack
import numpy as np
import zmq

import tpusync
from harness.polling import wait_for
from tpusync.engines.reference.engine import Engine
from tpusync.engines.reference.model import ModelConfig
from tpusync.kv.events import BlockAnnouncer, KVEventPublisher, decode_record, encode_record, follow
from tpusync.kv.keys import BlockHasher, event_hash_of


def subscriber(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.RCVTIMEO, 10000)
    sub.connect(endpoint)
    return sub


def wait_connected(pub: KVEventPublisher, sub: zmq.Socket) -> None:
    """PUB drops messages until the subscription arrives: publish probes until one is seen."""
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    for _ in range(500):
        pub.all_cleared()
        if poller.poll(20):
            sub.recv_multipart()
            while poller.poll(0):
                sub.recv_multipart()
            return
    raise AssertionError("subscriber never connected")


def test_engine_publishes_block_stored_with_the_router_hashes():
    cfg = ModelConfig(max_seq=512, layers=2, d_model=128, mlp=256)
    pub = KVEventPublisher("tcp://127.0.0.1:0", "kv@10.0.0.1:8000@m")
    sub = subscriber(pub.endpoint)
    wait_connected(pub, sub)
    prompt = np.random.default_rng(0).integers(0, 256, 100).tolist()
    with tpusync.KVStore.local(dram_bytes=4 << 20, block_bytes=cfg.page_bytes) as store:
        Engine(cfg, store=store, kv_events=pub, kv_events_audit_s=0).generate(prompt, 2)
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv@10.0.0.1:8000@m"
    assert struct.unpack(">Q", seq)[0] >= 1
    ts, events, dp_rank = msgpack.unpackb(payload)
    assert dp_rank == 0 and isinstance(ts, float)
    (tag, hashes, parent, tokens, block_size, lora_id, medium), *removed = events
    digests = BlockHasher(cfg.page_size).digests(prompt)
    assert tag == "BlockStored" and medium == "CPU" and block_size == 32 and lora_id is None
    assert hashes == [event_hash_of(d) for d in digests] and parent is None
    assert tokens == prompt[:96]
    # This process never announced them on disk or the shared tier, but an earlier one may have:
    # withdrawn there.
    assert removed == [["BlockRemoved", hashes, "DISK"], ["BlockRemoved", hashes, "SHARED_STORAGE"]]
    pub.close()
    sub.close()


class _Recorder:
    def __init__(self):
        self.batches = []

    def send(self, events):
        self.batches.append(events)
        return len(self.batches) - 1


def test_announcer_follows_tiers_in_runs_and_withdraws_what_left():
    pub = _Recorder()
    ann = BlockAnnouncer(pub, 2)
    hashes, tokens = [11, 12, 13, 14], list(range(8))
    # DRAM, DRAM+disk, disk, DRAM: held prefix of 4.
    keys = [111, 112, 113, 114]
    assert ann.announce(hashes, keys, tokens, [1, 3, 2, 1], 4) == 0
    stored = [e for e in pub.batches[0] if e[0] == "BlockStored"]
    assert [(e[1], e[2], e[3], e[6]) for e in stored] == [
        ([11, 12], None, [0, 1, 2, 3], "CPU"),
        ([12, 13], 11, [2, 3, 4, 5], "DISK"),
        ([14], 13, [6, 7], "CPU"),
    ]
    assert [e for e in pub.batches[0] if e[0] == "BlockRemoved"] == [
        ["BlockRemoved", [13], "CPU"], ["BlockRemoved", [11, 14], "DISK"],
        ["BlockRemoved", [11, 12, 13, 14], "SHARED_STORAGE"]]
    # Block 12 left DRAM, 13 and 14 are gone: only what was announced is withdrawn.
    assert ann.announce(hashes, keys, tokens, [1, 2, 0, 0], 2) == 1
    assert pub.batches[1] == [
        ["BlockStored", [11], None, [0, 1], 2, None, "CPU"],
        ["BlockStored", [12], 11, [2, 3], 2, None, "DISK"],
        ["BlockRemoved", [12, 14], "CPU"], ["BlockRemoved", [13], "DISK"]]
    # Nothing held and nothing announced anywhere: nothing to say.
    assert ann.announce([21], [121], [0, 1], [0], 0) == 2  # unknown to this process: withdrawn everywhere
    assert ann.announce([21], [121], [0, 1], [0], 0) is None


def test_audit_announces_what_the_store_did_since():
    pub = _Recorder()
    ann = BlockAnnouncer(pub, 2)
    ann.announce([11, 12], [111, 112], [5, 6, 7, 8], [1, 1], 2)
    where = {111: 1, 112: 1}
    assert ann.audit(lambda keys: [where[k] for k in keys]) is None  # nothing changed
    where.update({111: 3, 112: 0})  # written behind to disk; evicted
    assert ann.audit(lambda keys: [where[k] for k in keys]) == 1
    assert pub.batches[1] == [["BlockRemoved", [12], "CPU"],
                              ["BlockStored", [11], None, [5, 6], 2, None, "DISK"]]
    where.update({111: 2, 112: 1})  # 11 left DRAM; 12 came back (another engine on the host)
    assert ann.audit(lambda keys: [where[k] for k in keys]) == 2
    assert pub.batches[2] == [["BlockStored", [12], 11, [7, 8], 2, None, "CPU"],
                              ["BlockRemoved", [11], "CPU"]]


def test_a_block_in_parts_is_announced_tokenless_while_every_part_is_held():
    pub = _Recorder()
    ann = BlockAnnouncer(pub, 4, remember=2)
    where = {1: 1, 2: 0, 3: 1, 4: 1}  # block 21: keys 1 and 2; block 22: keys 3 and 4
    look = lambda keys: [where[k] for k in keys]  # noqa: E731
    assert ann.track([21, 22], [[1, 2], [3, 4]], look) == 0
    assert pub.batches[0] == [["BlockStored", [22], None, [], 4, None, "CPU"]]  # 21 lacks a part
    where[2] = 1  # its other part arrives (the change feed's key)
    assert ann.audit(look, [2]) == 1
    assert pub.batches[1] == [["BlockStored", [21], None, [], 4, None, "CPU"]]
    where.update({1: 3, 2: 2})  # both parts on disk, one also in DRAM: the block is on disk
    where.update({3: 1, 4: 2})  # parts on different tiers: the slower one
    assert ann.audit(look) == 2
    assert pub.batches[2] == [["BlockRemoved", [21, 22], "CPU"],
                              ["BlockStored", [21], None, [], 4, None, "DISK"],
                              ["BlockStored", [22], None, [], 4, None, "DISK"]]
    assert ann.track([23], [[5]], lambda keys: [0]) is None  # past `remember`: 21 is forgotten
    assert ann.unknown([1, 2, 3, 5]) == [1, 2]


def test_follow_announces_an_eviction_when_the_store_makes_it():
    """No audit timer: the store's change feed names the block that left DRAM, and the
    announcer withdraws it (a block it did not change is not looked up again)."""
    block = 4096
    pub = _Recorder()
    ann = BlockAnnouncer(pub, 2)
    with tpusync.KVStore.local(dram_bytes=8 * block, block_bytes=block) as store:
        keys = [1001, 1002, 1003]
        store.put(keys, [np.full(block, i, np.uint8) for i in range(3)])
        ann.announce([11, 12, 13], keys, list(range(6)), store.lookup(keys).tiers.tolist(), 3)
        stop = threading.Event()
        t = threading.Thread(target=follow, args=(ann, store, stop), kwargs={"wait_s": 0.2})
        t.start()
        try:
            store.evict([1002])  # no disk tier: the block is gone
            wait_for("the eviction withdrawn", lambda: ["BlockRemoved", [12], "CPU"] in pub.batches[-1], 30)
        finally:
            stop.set()
            t.join()
    assert all(["BlockRemoved", [11], "CPU"] not in b and ["BlockRemoved", [13], "CPU"] not in b for b in pub.batches)


def test_a_block_record_round_trips_and_a_foreign_one_reads_as_none():
    record = encode_record(12, [1, 2, 3, 4], lora_id=7)
    assert decode_record(record) == (12, array("I", [1, 2, 3, 4]), 7)
    assert decode_record(encode_record(None, [5, 6])) == (None, array("I", [5, 6]), None)
    assert decode_record(record[:-1]) is None  # not whole tokens
    assert decode_record(record[:16]) is None  # no tokens
    assert decode_record(b"\x02" + record[1:]) is None  # a version this one does not read


def _shared_stored(pub: _Recorder) -> dict[int, tuple[int | None, list[int]]]:
    """hash -> (parent, tokens) of the blocks a recorder was last told are on the shared tier."""
    held: dict[int, tuple[int | None, list[int]]] = {}
    for batch in pub.batches:
        for e in batch:
            if e[0] == "BlockStored" and e[6] == "SHARED_STORAGE":
                for i, h in enumerate(e[1]):
                    held[h] = (e[2] if i == 0 else e[1][i - 1], e[3][i * e[4]:(i + 1) * e[4]])
            elif e[0] == "BlockRemoved" and e[2] == "SHARED_STORAGE":
                for h in e[1]:
                    held.pop(h, None)
    return held


def test_every_engine_on_a_shared_tier_announces_what_another_host_stored(tmp_path):
    """Hosts a, b and c mount one shared tier. a's engine stores and announces a prompt's blocks
    (in DRAM: "CPU"). b's engine never saw the prompt, yet announces every block as
    SHARED_STORAGE with a's parents and tokens once its scan finds them; c, started later,
    finds them in the tier's catalog. Removed from the tier behind their backs (another host's
    evictor), they are withdrawn."""
    block = 4096
    shared = {"block_bytes": block, "dram_bytes": 8 * block, "shared_dir": tmp_path, "shared_layout": "l",
              "shared_scan_interval_s": 0.05, "secret": b"the pool's secret, 16+ bytes"}
    keys, tokens = [2001, 2002, 2003], list(range(6))
    want = {2001: (None, [0, 1]), 2002: (2001, [2, 3]), 2003: (2002, [4, 5])}
    stop = threading.Event()
    threads = []

    def engine(store):
        pub = _Recorder()
        ann = BlockAnnouncer(pub, 2)
        threads.append(threading.Thread(target=follow, args=(ann, store, stop), kwargs={"wait_s": 0.1}))
        threads[-1].start()
        return pub, ann

    with tpusync.KVStore.local(**shared) as a, tpusync.KVStore.local(**shared) as b:
        try:
            pub_a, ann_a = engine(a)
            pub_b, _ = engine(b)
            a.put(keys, [np.full(block, i, np.uint8) for i in range(3)])
            ann_a.announce(keys, keys, tokens, a.lookup(keys).tiers.tolist(), 3)
            wait_for("b announces a's blocks", lambda: _shared_stored(pub_b) == want, 30)
            assert _shared_stored(pub_a) == {}  # a holds them in DRAM: "CPU", as announced
            with tpusync.KVStore.local(**shared) as c:
                pub_c, _ = engine(c)
                wait_for("c announces the catalog", lambda: _shared_stored(pub_c) == want, 30)
                for f in tmp_path.glob("tpusync-shared-v2/*/*/??/*"):
                    f.unlink()
                wait_for("b withdraws them", lambda: _shared_stored(pub_b) == {}, 30)
                wait_for("c withdraws them", lambda: _shared_stored(pub_c) == {}, 30)
                stop.set()
        finally:
            stop.set()
            for t in threads:
                t.join()
