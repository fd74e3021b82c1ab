"""A bounded soak: 12 clients on overlapping keys against two real sidecars, one of which is
killed (SIGKILL) and restarted on its pool and disk halfway through.

Blocks are content-addressed here as in production: a key's bytes are a function of the key,
so every read can be checked. Keys below EVICTABLE are never evicted and DRAM holds them
all, so every put of those that was acknowledged must still be readable at the end, on the
sidecar that acknowledged it, whatever was killed in between."""

from __future__ import annotations

import collections
import random
import threading

import numpy as np

import tpusync
from tests.integration.conftest import BLOCK, SECRET
from tpusync import errors

KEYS = 64
EVICTABLE = 48  # keys >= this may be evicted by the clients
CLIENTS = 12
OPS = 120


def content(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, BLOCK, dtype=np.uint8)


def test_soak_overlapping_clients_and_a_killed_sidecar(launch, tmp_path):
    disks = {name: str(tmp_path / f"disk-{name}") for name in "ab"}
    opts = {"dram_bytes": 128 * BLOCK, "disk_bytes": 256 * BLOCK}
    sidecars = {name: launch(name, disk_dir=disks[name], **opts) for name in "ab"}
    lock = threading.Lock()
    counts: collections.Counter[str] = collections.Counter()
    wrong: list[str] = []
    acked: dict[str, set[int]] = {"a": set(), "b": set()}  # puts that returned OK, per sidecar
    half = threading.Event()
    restarted = threading.Event()

    def connect(name: str) -> tpusync.KVStore:
        return tpusync.KVStore.connect(f"unix://{sidecars[name].control_socket}")

    def check(key: int, got: np.ndarray, where: str) -> None:
        if not np.array_equal(got, content(key)):
            with lock:
                wrong.append(f"block {key} from {where}")

    def one_op(rng: random.Random, stores: dict[str, tpusync.KVStore]) -> str:
        name = rng.choice("ab")
        other = "b" if name == "a" else "a"
        store = stores[name]
        keys = rng.sample(range(KEYS), rng.randint(1, 6))
        op = rng.choice(["put", "get", "pull", "push", "evict", "pin"])
        if op == "put":
            store.put(keys, [content(k) for k in keys])
            with lock:
                acked[name].update(keys)
        elif op == "get":
            out = [np.zeros(BLOCK, np.uint8) for _ in keys]
            for k, found, got in zip(keys, store.get(keys, out), out):
                if found:
                    check(k, got, name)
        elif op == "pull":
            store.read_remote(sidecars[other].address, keys)
            out = [np.zeros(BLOCK, np.uint8) for _ in keys]
            for k, found, got in zip(keys, store.get(keys, out), out):
                if found:
                    check(k, got, f"{name} after a pull from {other}")
        elif op == "push":
            with tpusync.KVStore.connect(f"tpusync://{sidecars[other].address}", secret=SECRET) as peer:
                peer.put(keys, [content(k) for k in keys])
                with lock:
                    acked[other].update(keys)
        elif op == "evict":
            store.evict([k for k in keys if k >= EVICTABLE])
        else:
            n, _ = store.lookup(keys, pin=True)
            store.release(keys[:n])
        return op

    def client(seed: int) -> None:
        rng = random.Random(seed)
        stores: dict[str, tpusync.KVStore] = {}
        for i in range(OPS):
            if i == OPS // 2:
                half.set()
            try:
                for name in "ab":
                    if name not in stores:
                        stores[name] = connect(name)
                op = one_op(rng, stores)
                outcome = f"{op} ok"
            except (errors.UnavailableError, errors.CapacityError, errors.PreconditionError, OSError) as e:
                outcome = f"failed {type(e).__name__}"
                for s in stores.values():
                    s.close()
                stores.clear()  # reconnect: the sidecar may have been restarted
            with lock:
                counts[outcome] += 1
        for s in stores.values():
            s.close()

    def killer() -> None:
        half.wait(120)
        b = sidecars["b"]
        b.kill()
        sidecars["b"] = launch("b2", pool_path=b.pool_path, control_socket=b.control_socket, disk_dir=disks["b"],
                               **opts)
        restarted.set()

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(CLIENTS)]
    threads.append(threading.Thread(target=killer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert restarted.is_set()
    print("\nsoak op counts:", dict(sorted(counts.items())))
    assert sum(counts.values()) == CLIENTS * OPS
    assert not wrong, wrong
    for name, keys in acked.items():
        durable = sorted(k for k in keys if k < EVICTABLE)
        with connect(name) as store:
            out = [np.zeros(BLOCK, np.uint8) for _ in durable]
            found = store.get(durable, out)
            lost = [k for k, f in zip(durable, found) if not f]
            assert not lost, f"{name} acknowledged these blocks and lost them: {lost}"
            for k, got in zip(durable, out):
                check(k, got, f"{name} at the end")
            stats = store.stats()
            assert stats["pinned"] == 0, stats
            assert stats["dropped"] == 0, stats
    assert not wrong, wrong
    assert counts["put ok"] > 0 and counts["pull ok"] > 0 and counts["push ok"] > 0
