"""tpusync.engines.upstream: upstream TPU Sync's API at upstream's module paths, opt-in, never shadowing
upstream; its KVCacheStore directory at upstream's semantics; its KVCacheManager host pool on a
real sidecar with JAX arrays on the CPU."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from tpusync.engines.upstream.kv_cache_store import KVCacheStore, RaidenBlockID, RaidenId

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run_python(code: str, env: dict[str, str] | None = None, path: str | None = None) -> subprocess.CompletedProcess:
    """A fresh interpreter, so the import system starts without aliases."""
    full = {k: v for k, v in os.environ.items() if k != "TPUSYNC_UPSTREAM_API"} | (env or {})
    if path is not None:
        full["PYTHONPATH"] = path
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                          cwd=REPO)


# -- the aliases ------------------------------------------------------------------------------

def test_nothing_is_aliased_without_the_opt_in():
    r = run_python("""
        from tpusync.engines import upstream
        assert not upstream.install_if_enabled()
        try:
            import tpu_raiden
        except ImportError:
            print("absent")
    """)
    assert r.stdout.strip() == "absent", r.stderr


def test_vllms_general_plugin_entry_point_installs_the_aliases_when_asked():
    """vLLM loads every `vllm.general_plugins` entry point in each process
    (vllm/plugins/__init__.py, load_plugins_by_group): ours for upstream's paths is in the
    installed package's metadata and installs them with the opt-in only."""
    code = """
        from importlib.metadata import entry_points
        [ep] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "tpusync-upstream"]
        ep.load()()
        from tpusync.engines import upstream
        print(upstream.installed())
    """
    assert run_python(code, env={"TPUSYNC_UPSTREAM_API": "1"}).stdout.strip() == "True"
    assert run_python(code).stdout.strip() == "False"


def test_the_opt_in_serves_upstreams_paths_from_tpusync():
    r = run_python("""
        from tpusync.engines import upstream
        assert upstream.install_if_enabled()
        import tpu_raiden
        import tpu_raiden.api.jax.kv_cache_manager as mgr
        import tpu_raiden.api.jax.kv_cache_store as store
        from tpu_raiden.api.common import BlockStatus
        import tpusync.engines.upstream.kv_cache_store as ours
        assert store is ours and mgr.KVCacheManager is tpu_raiden.KVCacheManager
        assert tpu_raiden.KVCacheStore is ours.KVCacheStore and tpu_raiden.RaidenId is ours.RaidenId
        assert BlockStatus.HOST.value == 3
        from tpu_sync.api.jax import weight_synchronizer
        import tpusync.engines.upstream.weight_synchronizer as ws
        assert weight_synchronizer is ws
        try:  # tpu_inference's __init__ tries these and passes on ImportError only
            __import__("tpu_sync.frameworks.jax._tpu_raiden_jax")
        except ImportError:
            print("ok")
    """, env={"TPUSYNC_UPSTREAM_API": "1"})
    assert r.stdout.strip() == "ok", r.stderr


def test_an_installed_upstream_is_never_shadowed(tmp_path):
    (tmp_path / "tpu_raiden").mkdir()
    (tmp_path / "tpu_raiden" / "__init__.py").write_text("REAL = True\n")
    r = run_python("""
        from tpusync.engines import upstream
        try:
            upstream.install_if_enabled()
        except upstream.UpstreamInstalled as e:
            print("refused:", e)
        import tpu_raiden
        assert tpu_raiden.REAL and not upstream.installed()
    """, env={"TPUSYNC_UPSTREAM_API": "1"}, path=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused: tpu_raiden (upstream TPU Sync) is installed"), r.stdout


# -- KVCacheStore: upstream's directory --------------------------------------------------------

def rid(chunk: int) -> RaidenId:
    return RaidenId("tpu_inference", "0", "kv_cache", chunk)


def test_lookup_stops_at_the_first_miss_without_pinning_or_refreshing():
    s = KVCacheStore(capacity=3)
    assert s.insert([b"a", b"b", b"c"], [rid(0), rid(1), rid(2)], on_host=True) == (True, [])
    got = s.lookup([b"a", b"x", b"c"])
    assert [(h, e.data_replica_idx) for h, e in got] == [(b"a", 0)]
    assert isinstance(got[0][1], RaidenBlockID)
    all_in, evicted = s.insert([b"d"], [rid(3)], on_host=True)  # a was looked up, yet stays oldest
    assert all_in and [(h, e.data_replica_idx) for h, e in evicted] == [(b"a", 0)]


def test_lookup_sees_at_most_capacity_minus_pinned():
    s = KVCacheStore(capacity=3)
    s.insert([b"a", b"b", b"c"], [rid(0), rid(1), rid(2)], on_host=True)
    assert s.pin([b"c"])
    assert [h for h, _ in s.lookup([b"a", b"b", b"c"])] == [b"a", b"b"]


def test_pin_is_all_or_nothing_counted_and_release_ignores_strangers():
    s = KVCacheStore(capacity=2)
    s.insert([b"a", b"b"], [rid(0), rid(1)], on_host=True)
    assert not s.pin([b"a", b"x"])  # nothing pinned: a is evicted first below
    assert s.pin([b"b"]) and s.pin([b"b"])
    s.release([b"b", b"x", b"never"])  # one of b's two pins; strangers ignored
    _, evicted = s.insert([b"c"], [rid(2)], on_host=True)
    assert [h for h, _ in evicted] == [b"a"]
    _, evicted = s.insert([b"d"], [rid(3)], on_host=True)  # b still pinned: c goes
    assert [h for h, _ in evicted] == [b"c"]
    s.release([b"b"])
    _, evicted = s.insert([b"e"], [rid(4)], on_host=True)  # b back at the recent end: d goes
    assert [h for h, _ in evicted] == [b"d"]


def test_insert_reports_present_hashes_and_upstreams_all_pinned_quirk():
    s = KVCacheStore(capacity=1)
    s.insert([b"a"], [rid(0)], on_host=True)
    assert s.insert([b"a"], [rid(9)], on_host=True) == (False, [])
    assert s.lookup([b"a"])[0][1].data_replica_idx == 0  # the first location stays
    s.pin([b"a"])
    assert s.insert([b"b"], [rid(1)], on_host=True) == (True, [])  # upstream: nothing inserted, still True
    assert s.lookup([b"b"]) == []


def test_the_controller_backed_store_is_refused():
    with pytest.raises(NotImplementedError, match="controller-backed"):
        KVCacheStore(capacity=4, num_shards=2)
    assert RaidenId("j", "0", "d", 1) == RaidenId("j", "0", "d", 1) != RaidenId("j", "0", "d", 2)


# -- KVCacheManager: the host pool on a sidecar -------------------------------------------------

SHAPES = [(8, 4, 2, 1, 8), (8, 4, 2, 1, 8)]  # tpu-inference's per-layer layout, 8 device blocks


class Runner:
    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)
        self.kv_caches = [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in SHAPES]


def make_manager(control_socket: str, host_blocks: int):
    from tpusync.engines.upstream.kv_cache_manager import KVCacheManager

    runner = Runner(1)  # the local named `runner` the constructor finds, as in tpu-inference
    return runner, KVCacheManager(kv_caches=runner.kv_caches, local_control_port=0,
                                  host_blocks_to_allocate=host_blocks, unsafe_skip_buffer_lock=True,
                                  control_socket=control_socket)


@pytest.fixture
def sidecar_socket(tmp_path):
    from tpusync.local import sidecars as sidecar
    from tpusync.local.sidecars import write_secret

    write_secret(tmp_path / "secret", os.urandom(16).hex())
    car = sidecar.launch(pool_path=str(tmp_path / "pool"), secret_file=str(tmp_path / "secret"),
                         dram_bytes=1 << 20, block_bytes=4096, control_socket=str(tmp_path / "c.sock"))
    try:
        yield car.control_socket
    finally:
        car.kill()


def test_blocks_go_to_the_sidecar_and_come_back_into_the_runners_cache(sidecar_socket):
    runner, mgr = make_manager(sidecar_socket, 4)
    saved = [np.asarray(layer)[[2, 5]] for layer in runner.kv_caches]
    chunks, future = mgr.d2h_auto_allocate([2, 5])
    future.Await()
    assert chunks == [0, 1] and future.IsReady()
    runner.kv_caches = [jnp.zeros_like(layer) for layer in runner.kv_caches]  # the device cache is reset
    mgr.h2d(chunks, [6, 7])
    for layer, want in zip(runner.kv_caches, saved):
        assert np.array_equal(np.asarray(layer[6:8]), want)
        assert not np.asarray(layer[:6]).any()
    mgr.close()


def test_a_full_pool_raises_and_unlocked_blocks_are_reclaimed_oldest_first(sidecar_socket):
    runner, mgr = make_manager(sidecar_socket, 3)
    first, _ = mgr.d2h_auto_allocate([0, 1, 2])
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        mgr.d2h_auto_allocate([3])
    mgr.unlock_blocks([first[1], 99])  # an unknown id is ignored
    mgr.unlock_blocks([first[0]])
    assert mgr.d2h_auto_allocate([3])[0] == [first[1]]  # unlocked first, so reclaimed first
    mgr.h2d([first[0]], [4])  # unlocked but not reclaimed: still readable
    assert np.array_equal(np.asarray(runner.kv_caches[0][4]), np.asarray(runner.kv_caches[0][0]))
    with pytest.raises(RuntimeError, match="hold nothing"):
        mgr.h2d([7], [0])  # never written
    mgr.close()


def test_the_runner_is_required():
    from tpusync.engines.upstream.kv_cache_manager import KVCacheManager

    caches = Runner(2).kv_caches
    with pytest.raises(ValueError, match="needs the model runner"):
        KVCacheManager(kv_caches=caches, local_control_port=0, host_blocks_to_allocate=4)
    with pytest.raises(ValueError, match="Must specify either"):
        KVCacheManager(kv_caches=caches, local_control_port=9100, max_blocks=8)


# -- KVCacheManager: transfers between two sidecars ----------------------------------------------

@pytest.fixture
def two_sidecars(tmp_path):
    from tpusync.local import sidecars as sidecar
    from tpusync.local.sidecars import write_secret

    write_secret(tmp_path / "secret", os.urandom(16).hex())
    cars = [sidecar.launch(pool_path=str(tmp_path / f"pool{i}"), secret_file=str(tmp_path / "secret"),
                           dram_bytes=1 << 20, block_bytes=4096, control_socket=str(tmp_path / f"c{i}.sock"))
            for i in range(2)]
    try:
        yield cars
    finally:
        for car in cars:
            car.kill()


def transfer_manager(car, seed: int, timeout_s: float = 30.0):
    from tpusync.engines.upstream.kv_cache_manager import KVCacheManager

    runner = Runner(seed)
    return runner, KVCacheManager(kv_caches=runner.kv_caches, local_control_port=int(car.address.rsplit(":", 1)[1]),
                                  max_blocks=4, num_slots=2, timeout_s=timeout_s, control_socket=car.control_socket)


def polled(mgr, want: str, timeout: float = 20.0) -> tuple[list[str], list[str], list[str]]:
    """poll_stats, called as an engine calls it each step, until `want` is reported."""
    import time

    deadline = time.monotonic() + timeout
    seen: tuple[list[str], list[str], list[str]] = ([], [], [])
    while time.monotonic() < deadline:
        out = mgr.poll_stats()
        seen = tuple(a + b for a, b in zip(seen, out))  # type: ignore[assignment]
        if any(want in part for part in out):
            return seen
    raise AssertionError(f"{want} never reported; saw {seen}")


def test_a_pull_lands_the_producers_blocks_and_frees_them_on_the_ack(two_sidecars):
    p_car, d_car = two_sidecars
    p_runner, p = transfer_manager(p_car, 1)
    d_runner, d = transfer_manager(d_car, 2)
    # The consumer asks first: its pull waits for the registration, as upstream's does.
    d.start_read(req_id="r1", uuid=7, remote_endpoint=p_car.address, remote_block_ids=[1, 3], local_block_ids=[5, 6])
    assert p.register_read("r1", 7, [1, 3])
    assert polled(d, "r1")[1] == ["r1"]
    for got, src in zip(d_runner.kv_caches, p_runner.kv_caches):
        assert np.array_equal(np.asarray(got)[[5, 6]], np.asarray(src)[[1, 3]])
    assert polled(p, "r1")[0] == ["r1"]  # acknowledged: done_sending
    assert not p.register_read("r2", 8, [])  # nothing to offer
    p.close()
    d.close()


def test_failed_pulls_are_reported_and_unacknowledged_sends_expire(two_sidecars):
    import socket

    p_car, d_car = two_sidecars
    _, p = transfer_manager(p_car, 1, timeout_s=0.5)
    _, d = transfer_manager(d_car, 2, timeout_s=0.5)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    d.start_read(req_id="dead", uuid=1, remote_endpoint=dead, remote_block_ids=[1], local_block_ids=[1])
    d.start_read(req_id="never", uuid=2, remote_endpoint=p_car.address, remote_block_ids=[1], local_block_ids=[1])
    d.start_read(req_id="uneven", uuid=3, remote_endpoint=p_car.address, remote_block_ids=[1, 2],
                 local_block_ids=[1])
    d.start_read(req_id="big", uuid=4, remote_endpoint=p_car.address, remote_block_ids=list(range(5)),
                 local_block_ids=list(range(5)))  # more than max_blocks
    d.start_read(req_id="empty", uuid=5, remote_endpoint=p_car.address, remote_block_ids=[], local_block_ids=[])
    seen = polled(d, "never")  # the last to fail: it waits out its timeout
    assert set(seen[2]) >= {"dead", "never", "uneven", "big"} and "empty" in seen[1]
    with pytest.raises(RuntimeError, match="str or list"):
        d.start_read(req_id="x", uuid=6, remote_endpoint=42, remote_block_ids=[1], local_block_ids=[1])
    assert p.register_read("lonely", 9, [2])
    assert polled(p, "lonely")[0] == ["lonely"]  # nobody pulled it: done_sending at the deadline
    p.close()
    d.close()


# -- WeightSynchronizer: versions written into the bound arrays in place --------------------------

def test_versions_land_in_the_bound_arrays_in_place(sidecar_socket):
    import jax

    from tpusync.engines.upstream.weight_synchronizer import WeightSynchronizer
    from tpusync.store import connect_sidecar
    from tpusync.weights import VersionedWeights as Trainer

    rng = np.random.default_rng(3)
    live = [jnp.zeros((16, 8), jnp.float32), jnp.zeros((8,), jnp.bfloat16)]
    total = jax.jit(lambda xs: sum(jnp.sum(x.astype(jnp.float32)) for x in xs))
    assert float(total(live)) == 0.0
    sync = WeightSynchronizer(live, local_port=0, listener_port=0, auto_h2d=True, control_socket=sidecar_socket)
    assert sync.num_shards == 1 and sync.num_layers == 2 and not sync.listener_port
    with pytest.raises(RuntimeError, match="no version of 'rollout'"):
        sync.h2d()
    versions = [[rng.normal(size=(16, 8)).astype(np.float32), np.asarray(rng.normal(size=8), jnp.bfloat16)]
                for _ in range(2)]
    with Trainer(connect_sidecar(sidecar_socket), "rollout") as trainer:
        trainer.publish(versions[0], 1)
        sync.h2d()
        for arr, want in zip(live, versions[0]):  # the same objects now hold version 1
            assert np.array_equal(np.asarray(arr), want)
        assert float(total(live)) == pytest.approx(sum(float(w.astype(np.float32).sum()) for w in versions[0]),
                                                   rel=1e-5)
        trainer.publish(versions[1], 2)
    sync.wait_for_transfer_completion(2, timeout=10)
    assert np.array_equal(np.asarray(live[0]), versions[1][0])
    assert sync.get_metrics()["version"] == 2 and sync.get_metrics()["h2d_call_count"] == 2
    with pytest.raises(RuntimeError, match="Bind weights failed"):
        sync.bind_weights(live[:1])
    sync.bind_weights([jnp.zeros((16, 8), jnp.float32), jnp.zeros((8,), jnp.bfloat16)])  # same layout: fine
    sync.close()


def test_the_top_level_upstream_names_have_upstreams_semantics():
    """tpusync.KVCacheStore / KVCacheManager / WeightSynchronizer are upstream's (d2h takes device
    blocks, then host blocks; the synchronizer binds a sampler's arrays); tpusync's own APIs go by
    names of their own, and upstream's manager, which tpusync does not implement, is not offered
    under its name."""
    import tpusync
    from tpusync import weights
    from tpusync.engines.upstream import kv_cache_manager, kv_cache_store, weight_synchronizer
    from tpusync.kv import cache as kv_cache

    assert tpusync.KVCacheManager is kv_cache_manager.KVCacheManager
    assert tpusync.KVCacheStore is kv_cache_store.KVCacheStore
    assert tpusync.PageMover is kv_cache.PageMover and tpusync.PrefixStore is kv_cache.PrefixStore
    assert tpusync.WeightSynchronizer is weight_synchronizer.WeightSynchronizer
    assert next(iter(inspect.signature(tpusync.WeightSynchronizer).parameters)) == "jax_arrays"
    assert tpusync.VersionedWeights is weights.VersionedWeights
    assert tpusync.WeightDistributor is weights.WeightDistributor
    with pytest.raises(AttributeError):
        tpusync.WeightSynchronizerManager  # noqa: B018
    assert list(inspect.signature(tpusync.KVCacheManager.d2h).parameters)[1:3] == ["src_offsets", "dst_offsets"]
