#!/usr/bin/env python3
"""The device check (issue 45): tpusync's JAX page paths on an accelerator's memory, checked for
equal bytes and tokens, and measured against the framework's own fastest host copy.

On the JAX platform it is given (`--platform gpu` on a machine with a GPU; `cpu` here, where
make test runs the same steps with CPU arrays, `--quick`), in one process with sidecars started
on 127.0.0.1:
1. pd-reference: `make demo`'s disaggregated serving with its model servers on that platform:
   prefill and decode through two sidecars, tokens equal to a monolithic server's, then a
   prefix-cache hit (the demo exits non-zero on any mismatch).
2. pages: a paged KV cache on the device saved into a sidecar's pool and loaded back, bytes
   equal; and blocks saved from a cache split in two (two CPU devices) loaded into the device's
   single cache (load_pages_resharded), bytes equal.
3. d2h-jax / h2d-jax: device -> pool (save_pages) and pool -> device (load_pages) for blocks of
   64 KiB to 64 MiB, contiguous (a block is one layer's page) and layer-strided (a block is the
   pages of 8 layers), each rep beside the framework's own copy of the same bytes: JAX's
   device_put into and out of its pinned_host memory where the device has one; on the CPU,
   whose arrays are host memory already, a memcpy.
4. pd-qwen3-235b-<N>k: the KV cache of an N-token request shaped like Qwen3-235B (94 layers x
   K,V x 4 KV heads x 128 x bf16 a token, 16-token pages) moved device -> pool A -> pull ->
   pool B -> device, against the framework's copy out + raw TCP streams + its copy in.

ratio = tpusync's throughput / the baseline's (the target is >= 0.9); each case names the
device. Prints a table and writes JSON (`--out`; make device-check: bench/results/device.json).
Exits non-zero when bytes or tokens differ. JAX cannot register memory it did not allocate as
page-locked host memory, so on a GPU tpusync's copies go through pageable memory (the pool's
shared memory): the figures say what that costs against JAX's pinned copies.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KIB, MIB = 1 << 10, 1 << 20
QWEN3_235B_LAYERS, QWEN3_235B_LAYER_TOKEN_BYTES = 94, 2 * 4 * 128 * 2  # K,V x 4 KV heads x 128 x bf16
QWEN_PAGE_TOKENS = 16
STRIDED_LAYERS = 8


@dataclass(frozen=True)
class Sizes:
    blocks: tuple[int, ...]  # block bytes of the d2h/h2d cases
    case_bytes: int          # bytes moved per rep in each of them
    qwen_tokens: int
    reps: int
    demo_requests: int


FULL = Sizes(blocks=(64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB), case_bytes=256 * MIB,
             qwen_tokens=8192, reps=5, demo_requests=2)
QUICK = Sizes(blocks=(64 * KIB, MIB), case_bytes=8 * MIB, qwen_tokens=256, reps=2, demo_requests=1)


def configure(platform: str) -> None:
    """Before JAX is imported: the platform, with the CPU beside it (two CPU devices: the split
    cache of the resharded check), and no preallocation of the device's memory (the demo's three
    model servers share it)."""
    os.environ["JAX_PLATFORMS"] = "cpu" if platform == "cpu" else f"{platform},cpu"
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", default="cuda", help="JAX platform: cuda, rocm, tpu or cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU run in make test)")
    ap.add_argument("--out", required=True, help="the JSON results file")
    args = ap.parse_args()
    configure(args.platform)
    return Check(args.platform, QUICK if args.quick else FULL).run(args.out)


class Check:
    def __init__(self, platform: str, sizes: Sizes):
        import jax

        self.jax = jax
        self.platform, self.sizes = platform, sizes
        self.device = jax.devices(platform)[0]
        self.cpus = jax.devices("cpu")
        self.name = self.device.device_kind if platform != "cpu" else "cpu"
        self.pinned = ("pinned_host" in {m.kind for m in self.device.addressable_memories()}
                       and platform != "cpu")
        self.problems: list[str] = []
        self.work = tempfile.mkdtemp(prefix="tpusync-device-check-")

    # ---- sidecars

    def sidecar(self, block: int, pool_bytes: int) -> tuple[Any, Any]:
        """A sidecar with `pool_bytes` of `block`-byte slots, and an engine's store on it."""
        import tpusync
        from tpusync.local import sidecars

        secret = os.path.join(self.work, "secret")
        if not os.path.exists(secret):
            sidecars.write_secret(secret, uuid.uuid4().hex * 2)
        side = sidecars.launch(pool_path=f"/dev/shm/tpusync-device-{uuid.uuid4().hex[:8]}", secret_file=secret,
                               dram_bytes=pool_bytes, block_bytes=block,
                               control_socket=os.path.join(self.work, f"{uuid.uuid4().hex[:8]}.sock"),
                               stderr=subprocess.DEVNULL)
        return side, tpusync.KVStore.connect(f"unix://{side.control_socket}")

    # ---- the framework's own copies (the baselines)

    def to_host(self, layers: list[Any]) -> list[Any]:
        """The framework's fastest copy of these arrays into host memory."""
        jax = self.jax
        if self.pinned:
            sharding = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
            return jax.block_until_ready([jax.device_put(x, sharding) for x in layers])
        import numpy as np
        return [np.array(x, copy=True) for x in layers]  # CPU arrays are host memory: a memcpy

    def landing(self, layers: list[Any]) -> list[Any]:
        """Where to_device copies to on the CPU (allocated and touched untimed); nothing on a device."""
        import numpy as np
        return [] if self.pinned else [np.ones(x.shape, x.dtype) for x in layers]

    def to_device(self, host: list[Any], landing: list[Any]) -> None:
        """The framework's fastest copy of to_host's arrays into device memory (on the CPU: a
        memcpy into `landing`)."""
        jax = self.jax
        if self.pinned:
            sharding = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
            jax.block_until_ready([jax.device_put(x, sharding) for x in host])
            return
        import numpy as np
        for src, dst in zip(host, landing):
            np.copyto(dst, src)

    # ---- the steps

    def run(self, out: str) -> int:
        from report import RATE_COLUMNS, report
        from rich.console import Console

        console = Console(width=max(Console().width, 140))
        results = [self.pd_reference(), self.pages()]
        for block in self.sizes.blocks:
            for layers in (1, STRIDED_LAYERS):
                results += self.d2h_h2d(block, layers)
        results.append(self.pd_qwen())
        for r in results:
            r["device"] = self.name
        columns = RATE_COLUMNS + [("ratio range", "ratio_range", ""), ("baseline", "baseline", ""),
                                  ("device", "device", "")]
        report(console, f"tpusync on {self.name}: page paths against the framework's copies", results, columns,
               out, "ratio: tpusync's GB/s over the baseline's, each rep beside its baseline "
                    f"({'JAX pinned_host copies' if self.pinned else 'memcpy: the CPU has no device copy'})")
        for p in self.problems:
            console.print(f"[red]FAILED[/red] {p}")
        return 1 if self.problems else 0

    def pd_reference(self) -> dict:
        """make demo's P/D on this platform: tokens equal to monolithic serving, and a prefix hit."""
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "tpusync.demo", "--requests", str(self.sizes.demo_requests),
                               "--platform", self.platform], capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - t0
        if done.returncode:
            self.problems.append(f"pd-reference: the demo exited {done.returncode}:\n{done.stdout[-3000:]}"
                                 f"{done.stderr[-3000:]}")
        return {"case": "pd-reference", "seconds": seconds, "tokens_equal": done.returncode == 0,
                "requests": self.sizes.demo_requests}

    def cache(self, pages: int, page_shape: tuple[int, ...], layers: int, *, seed: int, device: Any = None) -> list:
        """`layers` arrays [pages, *page_shape] of random bf16 on the device."""
        jax, jnp = self.jax, self.jax.numpy
        keys = jax.random.split(jax.random.key(seed), layers)
        return [jax.device_put(jax.random.uniform(k, (pages, *page_shape), jnp.float32).astype(jnp.bfloat16),
                               device or self.device) for k in keys]

    def expect_equal(self, what: str, got: list, want: list, pages: int) -> None:
        import numpy as np
        for i, (g, w) in enumerate(zip(got, want)):
            g_bytes, w_bytes = (np.ascontiguousarray(np.asarray(x)[:pages]).view(np.uint8) for x in (g, w))
            if not np.array_equal(g_bytes, w_bytes):
                self.problems.append(f"{what}: layer {i}: the loaded pages differ from the saved ones")
                return

    def pages(self) -> dict:
        """Save and load on the device; saved from a cache split over two CPU devices, loaded resharded."""
        jax = self.jax
        from tpusync.kv.pages import load_pages, load_pages_resharded, save_pages

        pages, page_shape, layers = 8, (16, 4, 64), 4  # [tokens, kv heads, head dim]
        block = layers * 16 * 4 * 64 * 2
        side, store = self.sidecar(block, 4 * pages * block)
        before = len(self.problems)
        try:
            src = self.cache(pages, page_shape, layers, seed=1)
            keys = list(range(1000, 1000 + pages))
            save_pages(store, keys, src, range(pages))
            got, loaded = load_pages(store, keys, [self.jax.numpy.zeros_like(x) for x in src], range(pages))
            if loaded != pages:
                self.problems.append(f"pages: {loaded} of {pages} pages loaded")
            self.expect_equal("pages", got, src, pages)

            mesh = jax.sharding.Mesh(self.cpus[:2], ("heads",))
            split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "heads"))
            halves = [jax.device_put(x, split) for x in self.cache(pages, page_shape, layers, seed=2,
                                                                     device=self.cpus[0])]
            keys = list(range(2000, 2000 + pages))
            save_pages(store, keys, halves, range(pages))
            got, loaded = load_pages_resharded(store, keys, [self.jax.numpy.zeros_like(x) for x in src], range(pages),
                                               src_shards=2, axis=2)
            if loaded != pages:
                self.problems.append(f"pages resharded: {loaded} of {pages} pages loaded")
            self.expect_equal("pages resharded (2 -> 1)", got, halves, pages)
        finally:
            store.close()
            side.stop()
        return {"case": "pages-jax", "bytes_equal": len(self.problems) == before, "pages": pages, "layers": layers}

    def move(self, src: list, keys: list[int], source: Any, dest: Any, *, peer: str | None, what: str,
             check: bool) -> tuple[float, float, float]:
        """One round of tpusync's path: src's pages saved into `source`'s pool, pulled from `peer` (that
        pool's sidecar) by `dest` when given, loaded from `dest`'s pool into zeroed arrays on the
        device, then evicted from both. Seconds of the save, the pull and the load; `check`: the
        loaded bytes against src's."""
        from tpusync.kv.pages import load_pages, save_pages

        pages = len(keys)
        dst = self.jax.block_until_ready([self.jax.numpy.zeros_like(x) for x in src])
        t0 = time.perf_counter()
        save_pages(source, keys, src, range(pages))
        t1 = time.perf_counter()
        if peer is not None and not all(dest.read_remote(peer, keys)):
            self.problems.append(f"{what}: blocks missing after the pull")
        t2 = time.perf_counter()
        dst, loaded = load_pages(dest, keys, dst, range(pages))
        self.jax.block_until_ready(dst)
        t3 = time.perf_counter()
        if loaded != pages:
            self.problems.append(f"{what}: {loaded} of {pages} pages loaded")
        if check:
            self.expect_equal(what, dst, src, pages)
        for store in {id(source): source, id(dest): dest}.values():
            store.evict(keys)
        return t1 - t0, t2 - t1, t3 - t2

    def copies(self, src: list, landing: list) -> tuple[float, float]:
        """The framework's own copies of the same bytes: seconds out to host memory and back in."""
        t0 = time.perf_counter()
        host = self.to_host(src)
        t1 = time.perf_counter()
        self.to_device(host, landing)
        return t1 - t0, time.perf_counter() - t1

    def d2h_h2d(self, block: int, layers: int) -> list[dict]:
        """device -> pool and pool -> device of `case_bytes` in `block`-byte blocks of `layers` layers' pages."""
        pages = max(2, self.sizes.case_bytes // block)
        label = f"{block // KIB}k" if block < MIB else f"{block // MIB}m"
        layout = "contiguous" if layers == 1 else f"{layers}-layers"
        side, store = self.sidecar(block, (pages + 8) * block)
        saves, loads, outs, ins = [], [], [], []
        try:
            src = self.cache(pages, (block // layers // 2,), layers, seed=block + layers)
            landing = self.landing(src)
            for rep in range(self.sizes.reps + 1):  # rep 0: untimed (compiles the load's update)
                keys = [((rep + 1) << 32) + i for i in range(pages)]
                save, _, load = self.move(src, keys, store, store, peer=None, what=f"{label} {layout}",
                                          check=rep == 0)
                out, back = self.copies(src, landing)
                if rep:
                    saves.append(save)
                    loads.append(load)
                    outs.append(out)
                    ins.append(back)
        finally:
            store.close()
            side.stop()
        baseline = "jax pinned_host copy" if self.pinned else "memcpy"
        return [rate(f"d2h-jax-{label}-{layout}", pages * block, saves, outs, baseline),
                rate(f"h2d-jax-{label}-{layout}", pages * block, loads, ins, baseline)]

    def pd_qwen(self) -> dict:
        """A Qwen3-235B KV cache device -> pool A -> pull -> pool B -> device, against copy out + raw TCP + copy in."""
        import rawtcp

        tokens, streams = self.sizes.qwen_tokens, 4
        pages = tokens // QWEN_PAGE_TOKENS
        block = QWEN3_235B_LAYERS * QWEN_PAGE_TOKENS * QWEN3_235B_LAYER_TOKEN_BYTES
        a, ea = self.sidecar(block, (pages + 8) * block)
        b, eb = self.sidecar(block, (pages + 8) * block)
        moves, physical = [], []
        try:
            src = self.cache(pages, (QWEN_PAGE_TOKENS, QWEN3_235B_LAYER_TOKEN_BYTES // 2), QWEN3_235B_LAYERS, seed=3)
            landing = self.landing(src)
            for rep in range(self.sizes.reps + 1):
                keys = [((rep + 1) << 40) + i for i in range(pages)]
                phases = self.move(src, keys, ea, eb, peer=a.address, what="pd-qwen", check=rep == 0)
                out, back = self.copies(src, landing)
                raw = rawtcp.run(pages * block, streams, 1).seconds
                if rep:
                    moves.append(sum(phases))
                    physical.append(out + raw + back)
        finally:
            for store, side in ((ea, a), (eb, b)):
                store.close()
                side.stop()
        size = f"{tokens // 1024}k" if tokens >= 1024 else f"{tokens}t"
        return rate(f"pd-qwen3-235b-{size}", pages * block, moves, physical, f"copy out + raw-tcp-{streams}s + copy in")


def rate(case: str, nbytes: int, times: list[float], baselines: list[float], baseline: str) -> dict:
    """The medians, and each rep's ratio against the baseline run beside it."""
    from report import spread

    seconds, base = statistics.median(times), statistics.median(baselines)
    return {"case": case, "bytes": nbytes, "seconds": seconds, "baseline_seconds": base,
            "gbps": nbytes / seconds / 1e9, "baseline_gbps": nbytes / base / 1e9, "ratio": base / seconds,
            "baseline": baseline, **spread(list(zip(times, baselines)))}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # report, rawtcp
    sys.exit(main())
