"""tpusync.kv.torch_pages on the CPU (the vLLM tier has torch), through a real sidecar: blocks of
a torch paged cache saved and loaded back where they are told, a load that stops at the first
block the store lacks or holds with another length, caches it refuses, and the pool's
registration (none without CUDA). bench/device_check.py's torch steps run here too, with CPU
tensors, so the device check's torch half does not rot between loans of a GPU."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tpusync import KVStore, errors
from tpusync.kv.torch_pages import Pace, block_view, load_blocks, register_pool, save_blocks
from tpusync.local import sidecars
from tpusync.local.sidecars import write_secret

ROOT = Path(__file__).resolve().parents[2]
LAYERS, BLOCKS, SHAPE = 3, 6, (2, 16, 2, 32)  # [K/V, tokens, kv heads, head dim]
BLOCK = LAYERS * 2 * 16 * 2 * 32 * 2


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    work = tmp_path_factory.mktemp("torch-pages")
    write_secret(work / "secret", b"torch-pages-secret-0123456789abcd\n")
    pool = f"/dev/shm/tpusync-torchp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    side = sidecars.launch(pool_path=pool, secret_file=str(work / "secret"), dram_bytes=64 * BLOCK,
                           block_bytes=BLOCK, control_socket=str(work / "control.sock"), peers=[])
    s = KVStore.connect(f"unix://{side.control_socket}")
    yield s
    s.close()
    side.stop()
    if os.path.exists(pool):
        os.unlink(pool)


def cache(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand((BLOCKS, *SHAPE), generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def keys(tag: int, n: int = BLOCKS) -> list[int]:
    return [(tag << 16) + i for i in range(n)]


def test_blocks_come_back_where_they_are_told_byte_for_byte(store):
    src = cache(1)
    order = [4, 0, 5, 2]
    assert save_blocks(store, keys(1, 4), src, order) == 4 * BLOCK
    dst = [torch.zeros_like(x) for x in src]
    assert load_blocks(store, keys(1, 4), dst, [1, 3, 0, 2]) == 4
    for s, d in zip(src, dst):
        for stored, landed in zip(order, [1, 3, 0, 2]):
            assert torch.equal(d[landed].view(torch.uint8), s[stored].view(torch.uint8))
        assert not d[4].any() and not d[5].any()  # untouched
    # Saving again skips what is stored (content-addressed): nothing written.
    assert save_blocks(store, keys(1, 4), src, order) == 0


def test_a_load_stops_at_the_first_block_missing_or_of_another_length(store):
    src = cache(2)
    save_blocks(store, keys(2, 3), src, [0, 1, 2])
    store.put([keys(2, 5)[4]], [bytes(BLOCK // 2)])  # another cache's block: half the length
    dst = [torch.zeros_like(x) for x in src]
    assert load_blocks(store, keys(2, 5)[:2] + [keys(9, 1)[0]] + keys(2, 3)[2:], dst, [0, 1, 2, 3]) == 2
    assert not any(d[2].any() or d[3].any() for d in dst)  # nothing after the gap, never a part
    assert load_blocks(store, [keys(2, 5)[4]], dst, [5]) == 0
    assert not any(d[5].any() for d in dst)


def test_caches_it_cannot_take_are_refused(store):
    strided = torch.zeros((4, 8, 2))[:, ::2]  # a block is not contiguous
    with pytest.raises(errors.InvalidArgumentError, match="not contiguous"):
        block_view(strided)
    too_big = [torch.zeros((2, BLOCK + 1), dtype=torch.uint8)]  # a block over the store's
    with pytest.raises(errors.InvalidArgumentError, match="blocks hold"):
        save_blocks(store, keys(3, 1), too_big, [0])
    with pytest.raises(errors.InvalidArgumentError, match="no layers"):
        save_blocks(store, keys(3, 1), [], [0])
    with pytest.raises(ValueError, match="2 keys for 1 blocks"):
        load_blocks(store, keys(3, 2), cache(3), [0])


def test_without_cuda_the_pool_is_not_registered_and_the_region_is_the_mapping(store):
    address, size = store.pool_region()
    assert address > 0 and size >= 64 * BLOCK
    save_blocks(store, keys(4, 1), cache(4), [0])
    with store.acquire_many(keys(4, 1)) as views:
        view_address = torch.frombuffer(views[0], dtype=torch.uint8).data_ptr()
        assert address <= view_address < address + size  # a slot lies in the region
    assert not torch.cuda.is_available()
    with register_pool(store) as registered:
        assert registered is False


@pytest.mark.timeout(600)
def test_the_device_checks_torch_steps_run_on_the_cpu(tmp_path):
    out = tmp_path / "device.json"
    before = set(Path("/dev/shm").glob("tpusync-device-*"))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--platform", "cpu",
                           "--frameworks", "torch", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=550)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    results = {r["case"]: r for r in json.loads(out.read_text())}
    assert results["pages-torch"]["bytes_equal"] is True and results["pages-torch"]["pool_registered"] is False
    for size in ("64k", "1m"):
        for layout in ("contiguous", "8-layers"):
            for way in ("d2h", "h2d"):
                r = results[f"{way}-torch-{size}-{layout}"]
                assert r["device"] == "cpu" and r["baseline"] == "memcpy" and r["reps"] == 2, r
                assert r["ratio"] == pytest.approx(r["baseline_seconds"] / r["seconds"]), r
    assert not any(c.endswith("-pageable") for c in results)  # the unregistered variant is CUDA's alone
    for name in ("unpaced", "paced"):  # kernels on a thread beside the loading one (bytes checked by the script)
        r = results[f"stall-torch-{name}"]
        assert r["kernels_beside"] > 0 and r["kernel_ms_beside_max"] >= r["kernel_ms_beside"] > 0, r
        assert r["ratio"] == pytest.approx(r["kernel_ms"] / r["kernel_ms_beside"]), r
        assert r["bytes"] == 8 << 20 and r["device"] == "cpu", r
    # Its sidecars' pools, and the weight heads beside them, removed (weights-torch publishes).
    assert set(Path("/dev/shm").glob("tpusync-device-*")) == before


def test_a_paced_load_lands_the_same_bytes_in_chunks_that_cut_across_its_layers(store):
    src = cache(5)
    save_blocks(store, keys(5), src, range(BLOCKS))
    dst = [torch.zeros_like(x) for x in src]
    # 1000-byte chunks: every layer's 4096-byte part of a block is cut mid-element, four times
    assert load_blocks(store, keys(5), dst, range(BLOCKS), pace=Pace(chunk_bytes=1000, in_flight_bytes=3000)) == BLOCKS
    for s, d in zip(src, dst):
        assert torch.equal(d.view(torch.uint8), s.view(torch.uint8))


def test_a_pace_whose_chunk_exceeds_its_bound_is_refused():
    for chunk, bound in ((0, 1), (2, 1), (-1, 4)):
        with pytest.raises(errors.InvalidArgumentError, match="chunk_bytes"):
            Pace(chunk_bytes=chunk, in_flight_bytes=bound)


class RecordedCudart:
    """cudaHostRegister and cudaHostUnregister as calls recorded (no CUDA here; the device check
    runs the real ones on a GPU). `fail`: the error code the next registration returns."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail = 0

    def cudaHostRegister(self, address, size, flags):
        self.calls.append(("register", address, size, flags))
        err, self.fail = self.fail, 0
        return err

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = RecordedCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_registrations_of_one_pool_nest_and_the_last_out_unregisters_it(store, cudart):
    address, size = store.pool_region()
    with register_pool(store) as first:
        with register_pool(store) as second:
            assert first and second
        assert cudart.calls == [("register", address, size, 0)]  # once, though held twice
    assert cudart.calls[-1] == ("unregister", address)
    cudart.fail = 712  # cudaErrorHostMemoryAlreadyRegistered: another library holds the range
    with pytest.raises(errors.UnavailableError, match="CUDA error 712"), register_pool(store):
        pass
    with register_pool(store) as again:  # the failure left nothing behind: a fresh registration
        assert again and cudart.calls[-1] == ("register", address, size, 0)


def test_the_link_holds_its_companion_exactly_while_each_store_is_open(cudart):
    from tpusync.engines.connector.config import ConnectorConfig
    from tpusync.engines.connector.link import StoreLink

    held: list[str] = []

    @contextlib.contextmanager
    def companion(s):
        held.append("enter")
        try:
            yield True
        finally:
            held.append("exit")

    cfg = ConnectorConfig(store="local", pool_path=f"/dev/shm/tpusync-link-{uuid.uuid4().hex[:8]}",
                          dram_bytes=8 * BLOCK, retry_s=0.0)
    link = StoreLink(cfg, BLOCK, "the test", companion=companion)
    try:
        s = link.get()
        assert s is not None and held == ["enter"]
        assert link.get() is s and held == ["enter"]  # one store, one companion
        link.failed(RuntimeError("a call failed"))
        assert held == ["enter", "exit"]  # out before the store goes
        assert link.get() is not None and held == ["enter", "exit", "enter"]
    finally:
        link.close()
        if cfg.pool_path and os.path.exists(cfg.pool_path):
            os.unlink(cfg.pool_path)
    assert held[-1] == "exit"


def test_a_companion_that_fails_leaves_the_store_in_use(cudart):
    from tpusync.engines.connector.config import ConnectorConfig
    from tpusync.engines.connector.link import StoreLink

    cudart.fail = 2  # cudaErrorMemoryAllocation
    cfg = ConnectorConfig(store="local", pool_path=f"/dev/shm/tpusync-link-{uuid.uuid4().hex[:8]}",
                          dram_bytes=8 * BLOCK)
    link = StoreLink(cfg, BLOCK, "the test", companion=register_pool)
    try:
        s = link.get()
        assert s is not None  # used unregistered: CUDA stages its copies
        assert cudart.calls == [("register", *s.pool_region(), 0)]
    finally:
        link.close()
        if cfg.pool_path and os.path.exists(cfg.pool_path):
            os.unlink(cfg.pool_path)
    assert ("unregister", s.pool_region()[0]) not in cudart.calls  # nothing was registered
