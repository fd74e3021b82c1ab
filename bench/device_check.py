#!/usr/bin/env python3
"""The device check (issue 45): tpusync's JAX and torch page paths on an accelerator's memory,
checked for equal bytes and tokens, and measured against the framework's own fastest host copy.

On the platform it is given (`--platform cuda` on a machine with a GPU, bench/device/run.sh;
`cpu` here, where make test runs the same steps with CPU arrays, `--quick`), in one process with
sidecars started on 127.0.0.1:
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
   pool B -> device, against the framework's copy out + raw TCP streams + its copy in;
   dma-map-jax, whether the device's PJRT client takes the pool as DMA-mapped host memory.
5. torch (tpusync.kv.torch_pages, the blocks of vLLM's per-layer caches): pages-torch, a round
   trip with bytes equal; d2h-torch / h2d-torch as in 3, against torch's copies into and out of
   pinned host memory (pin_memory); on a CUDA device with the pool registered as page-locked
   host memory (cudaHostRegister: DMA straight from and into the pool) and, `-pageable`,
   without (CUDA stages the copies).
6. stall-torch-unpaced / -paced: matmul kernels on the compute stream while a 1 GiB load from
   the pool runs on a side stream, whole or paced (torch_pages.Pace: 16 MiB chunks, 64 MiB in
   flight, as upstream TPU Sync paces because one 1 GiB copy held TPU7x kernels up for 19 ms);
   ratio = the kernels' median time alone / beside the load, with the longest kernel beside it.
   On the CPU the kernels run on a thread beside the loading one.

ratio = tpusync's throughput / the baseline's (the target is >= 0.9); each case names the
device. Prints a table and writes JSON (`--out`; a device run's goes to bench/results/device.json).
Exits non-zero when bytes or tokens differ. tpusync's JAX page copies stage through host buffers
of their own (pageable memory): the figures say what that costs against JAX's pinned copies, and
dma-map-jax whether the device's client could take the pool itself for DMA (jaxlib's
Client.dma_map) and so spare the staging. `--frameworks` picks the
steps (make test runs the JAX ones in the main tier, the torch ones in the vLLM tier's torch).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
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
    stall_bytes: int         # the load beside the kernels of the stall cases
    stall_matrix: int        # their kernels: a matmul of two square matrices this wide


FULL = Sizes(blocks=(64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB), case_bytes=256 * MIB,
             qwen_tokens=8192, reps=5, demo_requests=2, stall_bytes=1 << 30, stall_matrix=4096)
QUICK = Sizes(blocks=(64 * KIB, MIB), case_bytes=8 * MIB, qwen_tokens=256, reps=2, demo_requests=1,
              stall_bytes=8 * MIB, stall_matrix=256)
STALL_BLOCK = 4 * MIB
WEIGHT_LEAVES = 16  # the weights case's tensors, stall_bytes in all, one pool block each


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
    ap.add_argument("--platform", default="cuda", choices=("cuda", "rocm", "tpu", "cpu"),
                    help="the accelerator: JAX's platform, and torch's cuda device on cuda and rocm")
    ap.add_argument("--frameworks", default="jax,torch", help="the steps to run: jax, torch or both")
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU runs in make test)")
    ap.add_argument("--out", required=True, help="the JSON results file")
    args = ap.parse_args()
    frameworks = set(args.frameworks.split(","))
    if not frameworks or frameworks - {"jax", "torch"}:
        ap.error(f"--frameworks {args.frameworks!r}: jax, torch or jax,torch")
    configure(args.platform)
    return Check(args.platform, QUICK if args.quick else FULL).run(sorted(frameworks), args.out)


class Check:
    """What every step shares: sizes, sidecars, the problems found, the report."""

    def __init__(self, platform: str, sizes: Sizes):
        self.platform, self.sizes = platform, sizes
        self.problems: list[str] = []
        self.work = ""  # the run's sockets and secret, removed at its end

    def run(self, frameworks: list[str], out: str) -> int:
        from report import RATE_COLUMNS, report
        from rich.console import Console

        console = Console(width=max(Console().width, 140))
        results: list[dict] = []
        with tempfile.TemporaryDirectory(prefix="tpusync-device-check-") as self.work:
            for framework in frameworks:
                steps = JaxSteps(self) if framework == "jax" else TorchSteps(self)
                results += [r | {"device": steps.name} for r in steps.run()]
        columns = RATE_COLUMNS + [("ratio range", "ratio_range", ""), ("baseline", "baseline", ""),
                                  ("device", "device", "")]
        report(console, "tpusync's page paths on a device against the framework's own copies", results, columns,
               out, "ratio: tpusync's GB/s over the baseline's, each rep beside its baseline (on the CPU, whose "
                    "arrays are host memory already, the baseline is a memcpy)")
        for p in self.problems:
            console.print(f"[red]FAILED[/red] {p}")
        return 1 if self.problems else 0

    @contextlib.contextmanager
    def sidecar(self, block: int, pool_bytes: int) -> Iterator[tuple[Any, Any]]:
        """A sidecar with `pool_bytes` of `block`-byte slots and an engine's store on it; both
        closed, and the pool removed (its file, its weight heads), when the block exits."""
        import tpusync
        from tpusync.local import sidecars

        secret = os.path.join(self.work, "secret")
        if not os.path.exists(secret):
            sidecars.write_secret(secret, uuid.uuid4().hex * 2)
        pool = f"/dev/shm/tpusync-device-{uuid.uuid4().hex[:8]}"
        side = sidecars.launch(pool_path=pool, secret_file=secret, dram_bytes=pool_bytes, block_bytes=block,
                               control_socket=os.path.join(self.work, f"{uuid.uuid4().hex[:8]}.sock"),
                               stderr=subprocess.DEVNULL)
        try:
            with tpusync.KVStore.connect(f"unix://{side.control_socket}") as store:
                yield side, store
        finally:
            side.stop()
            side.remove_pool()

    def expect_equal(self, what: str, got: list, want: list, pages: int) -> None:
        """The first `pages` pages of every layer equal byte for byte (numpy arrays, or arrays numpy reads)."""
        import numpy as np
        for i, (g, w) in enumerate(zip(got, want)):
            g_bytes, w_bytes = (np.ascontiguousarray(np.asarray(x)[:pages]).view(np.uint8) for x in (g, w))
            if not np.array_equal(g_bytes, w_bytes):
                self.problems.append(f"{what}: layer {i}: the loaded pages differ from the saved ones")
                return


class Steps:
    """One framework's steps: its device, its copies (the baselines) and tpusync's path."""

    framework: str  # jax or torch: in the cases' names
    name: str       # the device
    baseline: str   # the framework's copy the cases are measured against

    def __init__(self, check: Check):
        self.check = check
        self.sizes = check.sizes

    def run(self) -> list[dict]:
        raise NotImplementedError

    def cache(self, pages: int, page_shape: tuple[int, ...], layers: int, *, seed: int) -> list:
        raise NotImplementedError

    def landing(self, layers: list) -> list:
        raise NotImplementedError

    def copies(self, src: list, landing: list) -> tuple[float, float]:
        """The framework's own copies of the same bytes: seconds out to host memory and back in."""
        raise NotImplementedError

    def move(self, src: list, keys: list[int], source: Any, dest: Any, *, peer: str | None, what: str,
             check: bool) -> tuple[float, float, float]:
        """One round of tpusync's path: src's pages saved into `source`'s pool, pulled from `peer`
        (that pool's sidecar) by `dest` when given, loaded from `dest`'s pool into zeroed arrays on
        the device, then evicted from both. Seconds of the save, the pull and the load; `check`:
        the loaded bytes against src's."""
        raise NotImplementedError

    def pulled(self, dest: Any, peer: str | None, keys: list[int], what: str) -> float:
        """Seconds of `dest`'s pull of `keys` from `peer` (none: 0)."""
        t0 = time.perf_counter()
        if peer is not None and not all(dest.read_remote(peer, keys)):
            self.check.problems.append(f"{what}: blocks missing after the pull")
        return time.perf_counter() - t0

    def end_round(self, loaded: int, pages: int, what: str, source: Any, dest: Any, keys: list[int]) -> None:
        """Every page loaded, then the round's blocks evicted from both pools (the next round's fit)."""
        if loaded != pages:
            self.check.problems.append(f"{what}: {loaded} of {pages} pages loaded")
        for store in (source,) if source is dest else (source, dest):
            store.evict(keys)

    def d2h_h2d(self, block: int, layers: int, tag: str = "") -> list[dict]:
        """device -> pool and pool -> device of `case_bytes` in `block`-byte blocks of `layers` layers' pages."""
        pages = max(2, self.sizes.case_bytes // block)
        label = f"{block // KIB}k" if block < MIB else f"{block // MIB}m"
        layout = "contiguous" if layers == 1 else f"{layers}-layers"
        saves, loads, outs, ins = [], [], [], []
        with self.check.sidecar(block, (pages + 8) * block) as (_, store), self.registered(store, tag):
            src = self.cache(pages, (block // layers // 2,), layers, seed=block + layers)
            landing = self.landing(src)
            for rep in range(self.sizes.reps + 1):  # rep 0: untimed (compiles, first touches)
                keys = [((rep + 1) << 32) + i for i in range(pages)]
                save, _, load = self.move(src, keys, store, store, peer=None, what=f"{label} {layout}{tag}",
                                          check=rep == 0)
                out, back = self.copies(src, landing)
                if rep:
                    saves.append(save)
                    loads.append(load)
                    outs.append(out)
                    ins.append(back)
        return [rate(f"d2h-{self.framework}-{label}-{layout}{tag}", pages * block, saves, outs, self.baseline),
                rate(f"h2d-{self.framework}-{label}-{layout}{tag}", pages * block, loads, ins, self.baseline)]

    def registered(self, store: Any, tag: str) -> Any:
        """The pool registered with the device runtime for the case (where the framework can)."""
        return contextlib.nullcontext()


class JaxSteps(Steps):
    framework = "jax"

    def __init__(self, check: Check):
        super().__init__(check)
        import jax

        self.jax = jax
        self.device = jax.devices(check.platform)[0]
        self.cpus = jax.devices("cpu")
        self.name = self.device.device_kind if check.platform != "cpu" else "cpu"
        self.pinned = check.platform != "cpu" and "pinned_host" in {m.kind for m in self.device.addressable_memories()}
        self.baseline = "jax pinned_host copy" if self.pinned else "memcpy"

    def run(self) -> list[dict]:
        results = [self.pd_reference(), self.pages(), self.dma_map()]
        for block in self.sizes.blocks:
            for layers in (1, STRIDED_LAYERS):
                results += self.d2h_h2d(block, layers)
        results.append(self.pd_qwen())
        return results

    def dma_map(self) -> dict:
        """Whether the device's PJRT client takes the pool as DMA-mapped host memory
        (Client.dma_map, jaxlib's binding of PjRtClient::DmaMap; the CPU's answers UNIMPLEMENTED):
        the way for JAX's page copies to go straight from and into the pool, not staged."""
        client = self.device.client
        with self.check.sidecar(MIB, 8 * MIB) as (_, store):
            address, size = store.pool_region()
            try:
                client.dma_map(address, size)
            except Exception as e:  # noqa: BLE001 - jaxlib's JaxRuntimeError, whatever the plugin says
                return {"case": "dma-map-jax", "supported": False, "error": str(e)[:200]}
            client.dma_unmap(address)
        return {"case": "dma-map-jax", "supported": True}

    # ---- the framework's own copies (the baselines)

    def landing(self, layers: list) -> list:
        """Where the copy in lands on the CPU (allocated and touched untimed); nothing on a device."""
        import numpy as np
        return [] if self.pinned else [np.ones(x.shape, x.dtype) for x in layers]

    def copies(self, src: list, landing: list) -> tuple[float, float]:
        jax = self.jax
        t0 = time.perf_counter()
        if self.pinned:
            pinned = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
            host = jax.block_until_ready([jax.device_put(x, pinned) for x in src])
            t1 = time.perf_counter()
            device = jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
            jax.block_until_ready([jax.device_put(x, device) for x in host])
        else:
            import numpy as np
            host = [np.array(x, copy=True) for x in src]  # CPU arrays are host memory: a memcpy
            t1 = time.perf_counter()
            for h, dst in zip(host, landing):
                np.copyto(dst, h)
        return t1 - t0, time.perf_counter() - t1

    # ---- the steps

    def pd_reference(self) -> dict:
        """make demo's P/D on this platform: tokens equal to monolithic serving, and a prefix hit."""
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "tpusync.demo", "--requests", str(self.sizes.demo_requests),
                               "--platform", self.check.platform], capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - t0
        if done.returncode:
            self.check.problems.append(f"pd-reference: the demo exited {done.returncode}:\n{done.stdout[-3000:]}"
                                       f"{done.stderr[-3000:]}")
        return {"case": "pd-reference", "seconds": seconds, "tokens_equal": done.returncode == 0,
                "requests": self.sizes.demo_requests}

    def cache(self, pages: int, page_shape: tuple[int, ...], layers: int, *, seed: int, device: Any = None) -> list:
        """`layers` arrays [pages, *page_shape] of random bf16 on the device."""
        jax, jnp = self.jax, self.jax.numpy
        keys = jax.random.split(jax.random.key(seed), layers)
        return [jax.device_put(jax.random.uniform(k, (pages, *page_shape), jnp.float32).astype(jnp.bfloat16),
                               device or self.device) for k in keys]

    def pages(self) -> dict:
        """Save and load on the device; saved from a cache split over two CPU devices, loaded resharded."""
        jax = self.jax
        from tpusync.kv.pages import load_pages, load_pages_resharded, save_pages

        pages, page_shape, layers = 8, (16, 4, 64), 4  # [tokens, kv heads, head dim]
        block = layers * 16 * 4 * 64 * 2
        before = len(self.check.problems)
        with self.check.sidecar(block, 4 * pages * block) as (_, store):
            src = self.cache(pages, page_shape, layers, seed=1)
            keys = list(range(1000, 1000 + pages))
            save_pages(store, keys, src, range(pages))
            got, loaded = load_pages(store, keys, [jax.numpy.zeros_like(x) for x in src], range(pages))
            if loaded != pages:
                self.check.problems.append(f"pages: {loaded} of {pages} pages loaded")
            self.check.expect_equal("pages", got, src, pages)

            mesh = jax.sharding.Mesh(self.cpus[:2], ("heads",))
            split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "heads"))
            halves = [jax.device_put(x, split) for x in self.cache(pages, page_shape, layers, seed=2,
                                                                     device=self.cpus[0])]
            keys = list(range(2000, 2000 + pages))
            save_pages(store, keys, halves, range(pages))
            got, loaded = load_pages_resharded(store, keys, [jax.numpy.zeros_like(x) for x in src], range(pages),
                                               src_shards=2, axis=2)
            if loaded != pages:
                self.check.problems.append(f"pages resharded: {loaded} of {pages} pages loaded")
            self.check.expect_equal("pages resharded (2 -> 1)", got, halves, pages)
        return {"case": "pages-jax", "bytes_equal": len(self.check.problems) == before, "pages": pages,
                "layers": layers}

    def move(self, src: list, keys: list[int], source: Any, dest: Any, *, peer: str | None, what: str,
             check: bool) -> tuple[float, float, float]:
        from tpusync.kv.pages import load_pages, save_pages

        pages = len(keys)
        dst = self.jax.block_until_ready([self.jax.numpy.zeros_like(x) for x in src])
        t0 = time.perf_counter()
        save_pages(source, keys, src, range(pages))
        save = time.perf_counter() - t0
        pull = self.pulled(dest, peer, keys, what)
        t0 = time.perf_counter()
        dst, loaded = load_pages(dest, keys, dst, range(pages))
        self.jax.block_until_ready(dst)
        load = time.perf_counter() - t0
        if check:
            self.check.expect_equal(what, dst, src, pages)
        self.end_round(loaded, pages, what, source, dest, keys)
        return save, pull, load

    def pd_qwen(self) -> dict:
        """A Qwen3-235B KV cache device -> pool A -> pull -> pool B -> device, against copy out + raw TCP + copy in."""
        import rawtcp

        tokens, streams = self.sizes.qwen_tokens, 4
        pages = tokens // QWEN_PAGE_TOKENS
        block = QWEN3_235B_LAYERS * QWEN_PAGE_TOKENS * QWEN3_235B_LAYER_TOKEN_BYTES
        moves, physical = [], []
        with self.check.sidecar(block, (pages + 8) * block) as (a, ea), \
                self.check.sidecar(block, (pages + 8) * block) as (_, eb):
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
        size = f"{tokens // 1024}k" if tokens >= 1024 else f"{tokens}t"
        return rate(f"pd-qwen3-235b-{size}", pages * block, moves, physical, f"copy out + raw-tcp-{streams}s + copy in")


class TorchSteps(Steps):
    framework = "torch"

    def __init__(self, check: Check):
        super().__init__(check)
        import torch

        self.torch = torch
        cuda = check.platform in ("cuda", "rocm")
        if cuda and not torch.cuda.is_available():
            raise SystemExit(f"--platform {check.platform}: torch sees no CUDA device")
        self.device = torch.device("cuda" if cuda else "cpu")
        self.name = torch.cuda.get_device_name(self.device) if cuda else "cpu"
        self.baseline = "torch pinned copy" if cuda else "memcpy"

    def run(self) -> list[dict]:
        results = [self.pages()]
        for block in self.sizes.blocks:
            for layers in (1, STRIDED_LAYERS):
                results += self.d2h_h2d(block, layers)
                if self.device.type == "cuda":  # the fallback: the pool not registered
                    results += self.d2h_h2d(block, layers, tag="-pageable")
        results += self.weights()
        if self.device.type == "cuda":
            results += self.weights(tag="-pageable")
        return results + self.stall()

    def weights(self, tag: str = "") -> list[dict]:
        """A torch state dict on the device published as a version, then landed in place in
        parameters on the device the way the vLLM backend feeds load_weights: each leaf read off
        its pool slot (iter_torch) and copied into its parameter, against torch's pinned copies of
        the same tensors; bytes equal."""
        from tpusync import VersionedWeights
        from tpusync.kv.torch_pages import register_pool
        from tpusync.weights.inplace import iter_torch, pinned_version
        from tpusync.weights.leaves import single_block

        def land(store: Any, params: dict) -> None:
            """The version into `params` (each leaf's lease on its slot ends with this call)."""
            with pinned_version(store, "device-check", 1) as manifest:
                if not all(single_block(leaf) for leaf in manifest.leaves):
                    self.check.problems.append(f"weights-torch{tag}: a leaf spans blocks (not read in place)")
                for name, tensor in iter_torch(store, manifest):
                    params[name].copy_(tensor)

        torch, leaves = self.torch, WEIGHT_LEAVES
        leaf = self.sizes.stall_bytes // leaves
        source = {f"layers.{i}.weight": t for i, t in enumerate(self.cache(leaves, (leaf // 2,), 1, seed=11)[0])}
        params = {name: torch.zeros_like(t) for name, t in source.items()}
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.device.type == "cuda") for t in source.values()]
        back = [torch.zeros_like(t) for t in source.values()]  # the baseline's landing
        times, baselines = [], []
        with self.check.sidecar(leaf, (2 * leaves + 8) * leaf) as (_, store), \
                (contextlib.nullcontext() if tag else register_pool(store)):
            VersionedWeights(store, "device-check").publish(source, 1)
            for rep in range(self.sizes.reps + 1):  # rep 0: untimed, its landing checked
                for p in params.values():
                    p.zero_()
                self.sync()
                t0 = time.perf_counter()
                land(store, params)
                self.sync()
                landed = time.perf_counter() - t0
                if rep == 0:
                    self.check.expect_equal(f"weights-torch{tag}", self.numpy(list(params.values())),
                                            self.numpy(list(source.values())), leaf)
                for h, t in zip(pinned, source.values()):
                    h.copy_(t)
                self.sync()
                t0 = time.perf_counter()
                for b, h in zip(back, pinned):
                    b.copy_(h, non_blocking=True)
                self.sync()
                if rep:
                    times.append(landed)
                    baselines.append(time.perf_counter() - t0)
        return [rate(f"weights-torch{tag}", leaves * leaf, times, baselines, self.baseline)]

    def stall(self) -> list[dict]:
        """Kernels beside a load from the pool, unpaced and paced: whether a large load holds the
        device's compute up (the evidence for pacing by default, or not)."""
        from tpusync.kv.torch_pages import Pace, load_blocks, register_pool, save_blocks

        torch, n = self.torch, self.sizes.stall_matrix
        pages = self.sizes.stall_bytes // STALL_BLOCK
        kernel_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32  # the CPU has no fast bf16
        a = torch.rand((n, n), device=self.device).to(kernel_dtype)
        src = self.cache(pages, (STALL_BLOCK // 2,), 1, seed=7)
        keys = [(7 << 32) + i for i in range(pages)]
        results = []
        with self.check.sidecar(STALL_BLOCK, (pages + 8) * STALL_BLOCK) as (_, store), register_pool(store):
            save_blocks(store, keys, src, range(pages))
            alone = self.kernels_beside(a, 50, None)[0]
            for name, pace in (("unpaced", None), ("paced", Pace())):
                dst = [torch.zeros_like(src[0])]
                self.sync()
                load = functools.partial(load_blocks, store, keys, dst, range(pages), pace=pace)
                load()  # untimed: first touches
                count = max(20, int(3 * self.load_seconds(load) / (statistics.median(alone) / 1e3)))
                dst[0].zero_()
                times, starts, load_end_ms, seconds = self.kernels_beside(a, min(count, 20000), load)
                beside = [t for t, start in zip(times, starts) if start < load_end_ms]
                self.check.expect_equal(f"stall-torch-{name}", self.numpy(dst), self.numpy(src), pages)
                if not beside:
                    self.check.problems.append(f"stall-torch-{name}: no kernel ran beside the load")
                    beside = times
                results.append({
                    "case": f"stall-torch-{name}", "bytes": pages * STALL_BLOCK, "seconds": seconds,
                    "gbps": pages * STALL_BLOCK / seconds / 1e9, "baseline": "kernels alone",
                    "ratio": statistics.median(alone) / statistics.median(beside),
                    "kernel_ms": statistics.median(alone), "kernel_ms_beside": statistics.median(beside),
                    "kernel_ms_beside_max": max(beside), "kernels_beside": len(beside)})
        return results

    def load_seconds(self, load: Any) -> float:
        t0 = time.perf_counter()
        load()
        self.sync()
        return time.perf_counter() - t0

    def kernels_beside(self, a: Any, count: int, load: Any) -> tuple[list[float], list[float], float, float]:
        """`count` matmuls on the compute stream (CUDA) or a thread (CPU), and `load` (if any) on a
        side stream or the calling thread once they are queued or started: each kernel's ms, its
        start in ms from the first's, when the load ended in the same ms, and the load's seconds."""
        torch = self.torch
        out = torch.empty_like(a)
        if self.device.type == "cuda":
            timing = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(count)]
            for begin, end in timing:
                begin.record()
                torch.mm(a, a, out=out)
                end.record()
            side, done = torch.cuda.Stream(self.device), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                if load is not None:
                    load()  # returns once its copies are done (it waits for its stream per group)
                done.record(side)
            seconds = time.perf_counter() - t0
            torch.cuda.synchronize(self.device)
            first = timing[0][0]
            return ([b.elapsed_time(e) for b, e in timing], [first.elapsed_time(b) for b, _ in timing],
                    first.elapsed_time(done), seconds)
        import threading

        spans: list[tuple[float, float]] = []
        started = threading.Event()

        def kernels() -> None:
            for _ in range(count):
                t0 = time.perf_counter()
                torch.mm(a, a, out=out)
                spans.append((t0, time.perf_counter()))
                started.set()

        thread = threading.Thread(target=kernels)
        thread.start()
        started.wait()
        t0 = time.perf_counter()
        if load is not None:
            load()
        ended = time.perf_counter()
        thread.join()
        first = spans[0][0]
        return ([(e - b) * 1e3 for b, e in spans], [(b - first) * 1e3 for b, _ in spans], (ended - first) * 1e3,
                ended - t0)

    def registered(self, store: Any, tag: str) -> Any:
        from tpusync.kv.torch_pages import register_pool
        return contextlib.nullcontext() if tag == "-pageable" else register_pool(store)

    def cache(self, pages: int, page_shape: tuple[int, ...], layers: int, *, seed: int) -> list:
        """`layers` tensors [pages, *page_shape] of random bf16 on the device."""
        torch = self.torch
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return [torch.rand((pages, *page_shape), generator=gen, device=self.device).to(torch.bfloat16)
                for _ in range(layers)]

    def landing(self, layers: list) -> list:
        """Host tensors the copy out lands in (page-locked beside a CUDA device), then the
        device tensors the copy in lands in, allocated and touched untimed."""
        torch = self.torch
        pin = self.device.type == "cuda"
        host = [torch.ones(x.shape, dtype=x.dtype, pin_memory=pin) for x in layers]
        return host + [torch.ones_like(x) for x in layers]

    def copies(self, src: list, landing: list) -> tuple[float, float]:
        host, back = landing[:len(src)], landing[len(src):]
        t0 = time.perf_counter()
        for h, x in zip(host, src):
            h.copy_(x, non_blocking=True)
        self.sync()
        t1 = time.perf_counter()
        for d, h in zip(back, host):
            d.copy_(h, non_blocking=True)
        self.sync()
        return t1 - t0, time.perf_counter() - t1

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def numpy(self, layers: list) -> list:
        """Host numpy bytes of tensors (numpy has no bfloat16: their bytes as uint8)."""
        return [x.view(self.torch.uint8).cpu().numpy() for x in layers]

    def pages(self) -> dict:
        """A round trip of a cache's blocks through the pool, the pool registered where it can be."""
        from tpusync.kv.torch_pages import load_blocks, register_pool, save_blocks

        pages, layers = 8, 4
        src = self.cache(pages, (2, 16, 4, 64), layers, seed=1)  # [K/V, tokens, kv heads, head dim]
        block = layers * src[0][0].numel() * 2
        before = len(self.check.problems)
        with self.check.sidecar(block, 4 * pages * block) as (_, store), register_pool(store) as registered:
            keys = list(range(1000, 1000 + pages))
            order = list(reversed(range(pages)))  # blocks land where they are told, not in order
            save_blocks(store, keys, src, order)
            dst = [self.torch.zeros_like(x) for x in src]
            loaded = load_blocks(store, keys, dst, order)
            if loaded != pages:
                self.check.problems.append(f"pages-torch: {loaded} of {pages} blocks loaded")
            self.check.expect_equal("pages-torch", self.numpy(dst), self.numpy(src), pages)
        return {"case": "pages-torch", "bytes_equal": len(self.check.problems) == before, "pages": pages,
                "layers": layers, "pool_registered": registered}

    def move(self, src: list, keys: list[int], source: Any, dest: Any, *, peer: str | None, what: str,
             check: bool) -> tuple[float, float, float]:
        from tpusync.kv.torch_pages import load_blocks, save_blocks

        pages = len(keys)
        dst = [self.torch.zeros_like(x) for x in src]
        self.sync()
        t0 = time.perf_counter()
        save_blocks(source, keys, src, range(pages))
        save = time.perf_counter() - t0
        pull = self.pulled(dest, peer, keys, what)
        t0 = time.perf_counter()
        loaded = load_blocks(dest, keys, dst, range(pages))
        self.sync()
        load = time.perf_counter() - t0
        if check:
            self.check.expect_equal(what, self.numpy(dst), self.numpy(src), pages)
        self.end_round(loaded, pages, what, source, dest, keys)
        return save, pull, load


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
