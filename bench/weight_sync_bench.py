#!/usr/bin/env python3
"""Weight-sync benchmark: one trainer to 1, 2, 4 samplers, bf16 weights, real sidecars.

Measured in one run, each case beside its baseline:
- onehost-N-samplers: the trainer host sends one copy to one sampler host, where N sampler
  processes load it from the shared pool (time: transfer start -> last sampler swapped in);
  baseline: the same with 1 sampler, rep by rep in turns with it (at least 5);
- chain-N-hops: N simulated hosts (separate sidecars) in a pipelined chain, each pulling
  chunk c from the previous host as soon as it has it (time: until every host committed);
  baseline: one hop;
- naive-N-samplers: the trainer host sends every sampler host its own copy (all at once);
  baseline: 1 sampler;
- tcp-raw: four native raw TCP streams (bench/rawtcp.cc) carrying the same bytes, the
  loopback ceiling, with their CPU seconds;
- hop-vs-pull-loopback: ratio = one hop's throughput over a plain sidecar pull of the same
  bytes (naive-1), with CPU seconds per GB of the hop (sidecars + executor) against raw TCP's.
On the simulated fabric (harness/fabric.py: one network namespace per host, every
NIC shaped to the profile's rate and RTT, so hops no longer share one loopback):
- fabric-hop-1: the trainer host to one host, the baseline of the fabric cases;
- fabric-chain-N / fabric-tree-N (fan-out 2) / fabric-naive-N: N destination hosts besides
  the trainer's; ratio = seconds over one fabric hop of the same bytes, `vs_line_rate` =
  seconds over the bytes at the link's line rate;
- hop-vs-pull-fabric: a hop's throughput over a plain pull's, over the same link;
- fabric-raw-1 / fabric-raw-N-links: raw TCP over one link, and over the N links of a chain
  at once (the slowest), the physical floor of a chain: a middle host sends and receives.
Every case is the median of --reps runs; the fabric cases run rep by rep beside their
baseline, report the median of the reps' ratios with its spread (ratio_min, ratio_max,
ratio_runs) and the CPU time the hypervisor stole from this VM meanwhile (steal_percent).
Prints a table, what the plan predicts for a 235B-parameter bf16 model over 16 hosts at
50 GB/s per link, and writes bench/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from functools import partial
from pathlib import Path

import numpy as np
from rich.console import Console

from tpusync.local.sidecars import write_secret

# Run as `python bench/<name>.py`: bench/ is on sys.path (rawtcp, report); the repository
# root goes there too, for harness.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rawtcp
from report import merged, report

from harness import fabric as fab
from tpusync import KVStore
from tpusync.local import sidecars as sidecar
from tpusync.weights import VersionedWeights, WeightDistributor, plan

MIB, GIB = 1 << 20, 1 << 30
BLOCK = 16 * MIB  # a leaf fits one block: CPU samplers use the pool slot in place (see docs/weights.md)
LEAF = 16 * MIB
CHUNK_BLOCKS = 2  # 32 MiB chunks

SAMPLER = textwrap.dedent("""
    import sys, time
    import jax
    import jax.numpy as jnp
    import tpusync
    from tpusync.weights import VersionedWeights
    sock, version, leaves, leaf_elems = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sync = VersionedWeights(tpusync.KVStore.connect("unix://" + sock), "bench")
    # The weights it serves now, in memory before the clock starts (JAX fills arrays
    # asynchronously: four samplers' 1 GiB each would otherwise still be written during the
    # transfer).
    sync.bind_weights(jax.block_until_ready({f"w{i:03d}": jnp.zeros(leaf_elems, jnp.bfloat16) for i in range(leaves)}))
    print("READY", flush=True)
    sync.wait_for_version(version, timeout=600)
    done = time.time()
    assert float(sync.params["w000"][0]) == float(version)
    print(done, flush=True)
    sys.stdin.read()
""")


def weights(total: int, version: int) -> dict:
    import jax.numpy as jnp
    import ml_dtypes

    leaf_elems = LEAF // 2
    out = {}
    for i in range(total // LEAF):
        a = np.empty(leaf_elems, ml_dtypes.bfloat16)
        a[:] = version  # every byte written: pages are real, content is checkable
        out[f"w{i:03d}"] = jnp.asarray(a)
    return out


class Cluster:
    """Sidecars started for one case and removed after it (pools live in /dev/shm)."""

    def __init__(self, workdir: str, secret_file: str, total: int):
        self.workdir, self.secret_file, self.total = workdir, secret_file, total
        self.cars: list[sidecar.Sidecar] = []

    def host(self) -> sidecar.Sidecar:
        i = len(self.cars)
        pool = f"/dev/shm/tpusync-wbench-{os.getpid()}-{i}-{uuid.uuid4().hex[:6]}"
        car = sidecar.launch(pool_path=pool, secret_file=self.secret_file, dram_bytes=self.total + 64 * MIB,
                             block_bytes=BLOCK, control_socket=f"{self.workdir}/h{i}.sock", streams=4,
                             stderr=subprocess.DEVNULL)
        self.cars.append(car)
        return car

    def close(self) -> None:
        for car in self.cars:
            car.kill()
            car.remove_pool()


def engine(car) -> KVStore:
    return KVStore.connect(f"unix://{car.control_socket}")


def publish(car, total: int, version: int) -> float:
    t0 = time.perf_counter()
    VersionedWeights(engine(car), "bench", blocks_per_chunk=CHUNK_BLOCKS).publish(weights(total, version), version)
    return time.perf_counter() - t0


def manager(trainer, hosts) -> WeightDistributor:
    mgr = WeightDistributor(topology=plan.CHAIN)
    mgr.register_work_unit("trainer", host=trainer.address, control_socket=trainer.control_socket, role="trainer")
    for i, h in enumerate(hosts):
        mgr.register_work_unit(f"s{i}", host=h.address, control_socket=h.control_socket)
    return mgr


def onehost(workdir, secret_file, total: int, samplers: int) -> float:
    cl = Cluster(workdir, secret_file, total)
    procs = []
    try:
        trainer, host = cl.host(), cl.host()
        publish(trainer, total, 1)
        for _ in range(samplers):
            procs.append(subprocess.Popen([sys.executable, "-c", SAMPLER, host.control_socket, "1",
                                           str(total // LEAF), str(LEAF // 2)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:
            assert p.stdout.readline().strip() == "READY"
        mgr = manager(trainer, [host])
        start = time.time()
        report_ = mgr.transfer(["trainer"], None, "bench")
        assert report_.ok, report_.failed
        done = [float(p.stdout.readline()) for p in procs]
        mgr.close()
        return max(done) - start
    finally:
        for p in procs:
            p.kill()
            p.wait()
        cl.close()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes and of this one (the executor's checksums)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = sum(os.times()[:2])
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def chain(workdir, secret_file, total: int, hops: int) -> tuple[float, float]:
    """(seconds, CPU seconds of every sidecar and the executor) for a chain of `hops` hosts."""
    cl = Cluster(workdir, secret_file, total)
    try:
        trainer = cl.host()
        hosts = [cl.host() for _ in range(hops)]
        publish(trainer, total, 1)
        mgr = manager(trainer, hosts)
        pids = [c.process.pid for c in cl.cars]
        cpu0, t0 = cpu_seconds(pids), time.perf_counter()
        rep = mgr.transfer(["trainer"], None, "bench")
        seconds, cpu = time.perf_counter() - t0, cpu_seconds(pids) - cpu0
        assert rep.ok and len(rep.committed) == hops, rep.failed
        mgr.close()
        return seconds, cpu
    finally:
        cl.close()


def naive(workdir, secret_file, total: int, samplers: int) -> float:
    """Every sampler host pulls its own whole copy from the trainer host, all at once."""
    from tpusync.weights.storage import read_manifest, version_keys

    cl = Cluster(workdir, secret_file, total)
    try:
        trainer = cl.host()
        hosts = [cl.host() for _ in range(samplers)]
        publish(trainer, total, 1)
        keys = version_keys(read_manifest(engine(trainer), "bench", 1))
        return pull_all_at_once([engine(h) for h in hosts], trainer.address, keys)
    finally:
        cl.close()


def pull_all_at_once(stores: list[KVStore], address: str, keys: list[int]) -> float:
    """Seconds until every store has pulled all of keys from address, each in its own thread."""
    errors: list[BaseException] = []

    def pull(store):
        try:
            assert all(store.read_remote(address, keys))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=pull, args=(s,)) for s in stores]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    assert not errors, errors
    return seconds


def case(name: str, nbytes: int, seconds: float, baseline: float, cpu: float | None = None) -> dict:
    out = {"case": name, "bytes": nbytes, "seconds": seconds, "baseline_seconds": baseline,
           "ratio": seconds / baseline, "gbps": nbytes / seconds / 1e9,
           "load_avg_1m": os.getloadavg()[0]}  # this machine is shared: how busy it was, beside each figure
    if cpu is not None:   # how many cores the case kept busy: near os.cpu_count() means CPU-bound
        out |= {"cpu_seconds": cpu, "cores_busy": cpu / seconds, "cpu_s_per_gb": cpu / (nbytes / 1e9)}
    return out


def median_of(reps: int, fn) -> tuple[float, float | None]:
    """(median seconds, median CPU seconds or None) of `reps` calls of fn() -> seconds | (seconds, cpu)."""
    runs = [fn() for _ in range(reps)]
    runs = [r if isinstance(r, tuple) else (r, None) for r in runs]
    cpus = [c for _, c in runs if c is not None]
    return statistics.median(s for s, _ in runs), (statistics.median(cpus) if cpus else None)


# 1 MiB chunks: 8 ms on the fabric's 1 Gbit/s links, as 100 MiB chunks take on 100 Gbit/s ones
# (the fabric is the real one scaled down ~100x), so a chain fills in a few ms per hop.
FABRIC_BLOCK = MIB
FABRIC_CHUNK_BLOCKS = 1


class FabricCluster:
    """A fabric of 1 + n hosts (h0 is the trainer's), one sidecar in each."""

    def __init__(self, profile: fab.Profile, n: int, secret_file: str, total: int):
        self.fabric = fab.Fabric(1 + n, profile)
        self.fabric.start()
        try:
            self.cars = [h.sidecar(secret_file=secret_file, dram_bytes=total + 64 * MIB, block_bytes=FABRIC_BLOCK,
                                   streams=4) for h in self.fabric.hosts]
        except BaseException:
            self.fabric.close()
            raise
        self.trainer, self.hosts = self.cars[0], self.cars[1:]

    def publish(self, total: int) -> list[int]:
        """Publishes version 1 on the trainer's host; returns the version's block keys."""
        from tpusync.weights.storage import read_manifest, version_keys

        sync = VersionedWeights(engine(self.trainer), "bench", blocks_per_chunk=FABRIC_CHUNK_BLOCKS)
        sync.publish(weights(total, 1), 1)
        return version_keys(read_manifest(engine(self.trainer), "bench", 1))

    def close(self) -> None:
        self.fabric.close()


def fabric_transfer(profile, secret_file, total: int, n: int, topology: str) -> tuple[float, float]:
    """(seconds, CPU seconds of every sidecar and the executor): the version to n hosts."""
    cl = FabricCluster(profile, n, secret_file, total)
    try:
        cl.publish(total)
        mgr = WeightDistributor(topology=topology, fanout=2)
        mgr.register_work_unit("trainer", host=cl.trainer.address, control_socket=cl.trainer.control_socket,
                               role="trainer")
        for i, h in enumerate(cl.hosts):
            mgr.register_work_unit(f"s{i}", host=h.address, control_socket=h.control_socket)
        pids = [c.process.pid for c in cl.cars]
        before = cl.fabric.counters()
        cpu0, t0 = cpu_seconds(pids), time.perf_counter()
        rep = mgr.transfer(["trainer"], None, "bench")
        seconds, cpu = time.perf_counter() - t0, cpu_seconds(pids) - cpu0
        assert rep.ok and len(rep.committed) == n, rep.failed
        _assert_crossed(cl, before, total)
        mgr.close()
        return seconds, cpu
    finally:
        cl.close()


def fabric_naive(profile, secret_file, total: int, n: int) -> float:
    """Every destination host pulls its own whole copy from the trainer's host, all at once."""
    cl = FabricCluster(profile, n, secret_file, total)
    try:
        keys = cl.publish(total)
        stores = [engine(h) for h in cl.hosts]
        before = cl.fabric.counters()
        seconds = pull_all_at_once(stores, cl.trainer.address, keys)
        _assert_crossed(cl, before, total)
        return seconds
    finally:
        cl.close()


def _assert_crossed(cl: FabricCluster, before: dict, total: int) -> None:
    """Every destination's NIC received the version: the bytes went over the shaped links."""
    after = cl.fabric.counters()
    for h in cl.fabric.hosts[1:]:
        got = after[h.name].rx_bytes - before[h.name].rx_bytes
        assert got >= total, f"{h.name} received only {got} of {total} bytes over its link"


def fabric_cases(profile: fab.Profile, secret_file: str, total: int, hosts: list[int], reps: int) -> list[dict]:
    tag = f"{total // MIB}m-{profile.name}"
    line_rate = total / profile.rate_bytes_per_s

    # Every case runs once per rep right after that rep's hop (and the raw links after the raw
    # single link), so a drift of this shared machine's load, or the hypervisor taking its CPUs
    # (steal), hits a case and its baseline alike; each case's ratio is the median of its reps'.
    runs: dict[str, list] = {}
    steal: dict[str, list[float]] = {}

    def measure(name, fn):
        s0 = cpu_steal()
        runs.setdefault(name, []).append(fn())
        steal.setdefault(name, []).append(cpu_steal(s0))

    for _ in range(reps):
        measure("raw-1", partial(raw_links, profile, total, 1))
        measure("hop", partial(fabric_transfer, profile, secret_file, total, 1, plan.CHAIN))
        measure("pull", partial(fabric_naive, profile, secret_file, total, 1))
        for n in hosts:
            measure(f"raw-{n}", partial(raw_links, profile, total, n))
            for topology in (plan.CHAIN, plan.TREE):
                measure(f"{topology}-{n}", partial(fabric_transfer, profile, secret_file, total, n, topology))
            measure(f"naive-{n}", partial(fabric_naive, profile, secret_file, total, n))

    def seconds(name):
        return [r[0] if isinstance(r, tuple) else r for r in runs[name]]

    def fcase(name, key, base_key, cpu=None, floor=None):
        ratios = [a / b for a, b in zip(seconds(key), seconds(base_key))]
        out = case(name, total, statistics.median(seconds(key)), statistics.median(seconds(base_key)), cpu)
        out |= {"ratio": statistics.median(ratios), "ratio_runs": ratios, "ratio_min": min(ratios),
                "ratio_max": max(ratios), "steal_percent": statistics.median(steal[key]),
                "line_rate_seconds": line_rate, "vs_line_rate": out["seconds"] / line_rate}
        if floor is not None:  # the plan's link-limited time: k copies per uplink plus the pipeline fill
            out |= {"floor_seconds": floor, "vs_floor": out["seconds"] / floor}
        return out

    def cpu(name):
        return statistics.median(r[1] for r in runs[name])

    def floor(n: int, topology: str) -> float:
        return plan.predict(total, n, link_bytes_per_s=profile.rate_bytes_per_s,
                            chunk_bytes=FABRIC_BLOCK * FABRIC_CHUNK_BLOCKS, topology=topology, fanout=2).seconds

    out = [fcase(f"fabric-raw-1-{tag}", "raw-1", "raw-1"),
           fcase(f"fabric-hop-1-{tag}", "hop", "hop", cpu("hop"), floor(1, plan.CHAIN)),
           fcase(f"fabric-pull-1-{tag}", "pull", "hop")]
    pull_over_hop = out[-1]
    out.append(case(f"hop-vs-pull-fabric-{tag}", total, pull_over_hop["baseline_seconds"], pull_over_hop["seconds"])
               | {"ratio": 1 / pull_over_hop["ratio"], "pull_seconds": pull_over_hop["seconds"]})
    for n in hosts:
        out.append(fcase(f"fabric-raw-{n}-links-{tag}", f"raw-{n}", "raw-1"))
        for topology in (plan.CHAIN, plan.TREE):
            key = f"{topology}-{n}"
            out.append(fcase(f"fabric-{topology}-{n}-{tag}", key, "hop", cpu(key), floor(n, topology)))
        out.append(fcase(f"fabric-naive-{n}-{tag}", f"naive-{n}", "hop", floor=n * line_rate))
    return out


def raw_links(profile: fab.Profile, total: int, n: int) -> float:
    """The physical floor of a chain of n hops: raw TCP (4 streams, bench/rawtcp.cc) carrying
    `total` bytes over each of the n links h0 -> h1 -> ... -> hn at once, so every middle host
    sends and receives at the same time, as a relay does; the seconds of the slowest link."""
    f = fab.Fabric(1 + n, profile)
    f.start()
    try:
        h = f.hosts
        seconds = [0.0] * n

        def link(k: int) -> None:
            seconds[k] = rawtcp.run(total, 4, 1, bind_ip=h[k + 1].ip, recv_popen=h[k + 1].popen,
                                    send_popen=h[k].popen).seconds

        links = [threading.Thread(target=link, args=(k,)) for k in range(n)]
        for t in links:
            t.start()
        for t in links:
            t.join()
        assert all(seconds), "a raw link failed"
        return max(seconds)
    finally:
        f.close()


def cpu_steal(since: tuple[int, int] | None = None):
    """The CPU time the hypervisor took from this machine: (steal, total) jiffies now, or with
    `since`, the percentage stolen from then to now."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    now = (fields[7], sum(fields))
    if since is None:
        return now
    return 100 * (now[0] - since[0]) / max(1, now[1] - since[1])


PARTS = ("onehost", "chain", "naive", "fabric")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, nargs="*", default=[1.0],
                    help="weight sizes in GiB (e.g. 1 2); none: skip loopback")
    ap.add_argument("--samplers", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--reps", type=int, default=3, help="runs per case; the median is reported")
    ap.add_argument("--fabric-hosts", type=int, nargs="*", default=[4, 8], help="destination hosts; none: skip")
    ap.add_argument("--fabric-mib", type=int, default=128)
    ap.add_argument("--fabric-profile", default="dc", choices=sorted(fab.PROFILES))
    ap.add_argument("--only", default=",".join(PARTS),
                    help=f"comma list of parts to run, of {','.join(PARTS)}; a partial run updates --out in place")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "weight_sync.json"))
    args = ap.parse_args()
    only = set(args.only.split(","))
    console = Console(width=200)
    results = []
    with tempfile.TemporaryDirectory(prefix="tpusync-wbench-") as workdir:
        secret_file = f"{workdir}/secret"
        write_secret(secret_file, os.urandom(32).hex().encode())
        reps = args.reps
        for gib in args.gib:
            total = int(gib * GIB) // LEAF * LEAF
            tag = f"{gib:g}g"
            raw = rawtcp.run(total, 4, reps)
            results.append(case(f"tcp-raw-{tag}", total, raw.seconds, raw.seconds, raw.cpu_seconds))
            if "onehost" in only:
                # Rep by rep in turns (one sampler, then each N), at least 5: a drift of this shared
                # machine's load hits every case alike, and each rep's ratio gives the spread.
                runs: dict[int, list[float]] = {n: [] for n in (1, *args.samplers)}
                for _ in range(max(reps, 5)):
                    for n in runs:
                        runs[n].append(onehost(workdir, secret_file, total, n))
                one = statistics.median(runs[1])
                results.append(case(f"onehost-1-samplers-{tag}", total, one, one))
                for n in args.samplers:
                    per_rep = sorted(s / o for s, o in zip(runs[n], runs[1]))
                    results.append(case(f"onehost-{n}-samplers-{tag}", total, statistics.median(runs[n]), one)
                                   | {"reps": len(per_rep), "ratio_range": f"{per_rep[0]:.2f}-{per_rep[-1]:.2f}"})
            # One hop and one plain pull, rep by rep in turns, so a drift of this shared machine's
            # load hits both sides of hop-vs-pull alike.
            paired = [(chain(workdir, secret_file, total, 1), naive(workdir, secret_file, total, 1))
                      for _ in range(reps if {"chain", "naive"} <= only else 0)]
            if "chain" in only:
                hops = [h for h, _ in paired]
                hop, hop_cpu = (median_of(reps, partial(chain, workdir, secret_file, total, 1)) if not paired else
                                (statistics.median(h[0] for h in hops), statistics.median(h[1] for h in hops)))
                results.append(case(f"chain-1-hops-{tag}", total, hop, hop, hop_cpu))
                for n in args.samplers:
                    seconds, cpu = median_of(reps, partial(chain, workdir, secret_file, total, n))
                    results.append(case(f"chain-{n}-hops-{tag}", total, seconds, hop, cpu))
            if "naive" in only:
                base = (median_of(reps, partial(naive, workdir, secret_file, total, 1))[0] if not paired else
                        statistics.median(p for _, p in paired))
                results.append(case(f"naive-1-samplers-{tag}", total, base, base))
                for n in args.samplers:
                    s, _ = median_of(reps, partial(naive, workdir, secret_file, total, n))
                    results.append(case(f"naive-{n}-samplers-{tag}", total, s, base))
            if {"chain", "naive"} <= only:
                hvp = case(f"hop-vs-pull-loopback-{tag}", total, hop, base, hop_cpu)
                hvp |= {"ratio": base / hop, "pull_seconds": base,
                        "raw_cpu_s_per_gb": raw.cpu_seconds / (total / 1e9), "cpu_vs_raw": hop_cpu / raw.cpu_seconds}
                results.append(hvp)
            console.print(f"done {tag}")
        if args.fabric_hosts and "fabric" in only:
            total = args.fabric_mib * MIB // LEAF * LEAF
            results += fabric_cases(fab.PROFILES[args.fabric_profile], secret_file, total, args.fabric_hosts, reps)
    columns = [("case", "case", ""), ("seconds", "seconds", ".3f"), ("baseline s", "baseline_seconds", ".3f"),
               ("ratio", "ratio", ".2f"), ("ratio range (per rep)", "ratio_range", ""), ("GB/s", "gbps", ".2f"),
               ("vs line rate", "vs_line_rate", ".2f"),
               ("cores busy", "cores_busy", ".2f"), ("cpu s/GB", "cpu_s_per_gb", ".2f"),
               ("floor s", "floor_seconds", ".3f"), ("vs floor", "vs_floor", ".2f")]
    gb = 10**9
    model_bytes = 235 * gb * 2
    lines = ["Plan prediction, 235B params bf16 (470 GB) to 16 hosts at 50 GB/s per host link, 64 MiB chunks:"]
    for topo, k in ((plan.CHAIN, 1), (plan.TREE, 2), (plan.TREE, 4)):
        p = plan.predict(model_bytes, 16, link_bytes_per_s=50 * gb, chunk_bytes=64 * MIB, topology=topo, fanout=k)
        lines.append(f"  {topo}{'' if topo == plan.CHAIN else f' fan-out {k}'}: {p.seconds:.2f} s "
                     f"(depth {p.depth}); naive (trainer sends each host a copy): {p.naive_seconds:.1f} s")
    note = "\n".join(lines) + (f"\nLoopback on {os.cpu_count()} cores shared with other work: every hop costs CPU "
                               "(copy + checksum), so hops compete for the same cores; figures are noisy. "
                               "cores busy: CPU seconds of every sidecar and the executor per wall second.")
    note += ("\nfabric-*: ratio = seconds over one fabric hop (fabric-hop-1) of the same bytes; vs line rate = "
             "seconds over bytes / link rate; floor = the plan's link-limited time (plan.predict: k copies on each "
             "uplink plus depth - 1 chunks of pipeline fill; naive: one copy per host on the trainer's uplink). "
             "hop-vs-pull-*: ratio = a hop's throughput over a plain pull's.")
    if only != set(PARTS):
        results = merged(args.out, results)
    report(console, f"tpusync weight sync (median of {args.reps})", results, columns, args.out, note)


if __name__ == "__main__":
    main()
