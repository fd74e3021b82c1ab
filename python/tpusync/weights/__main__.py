"""python -m tpusync.weights: predict a plan, or run a local demo with a progress bar.

    python -m tpusync.weights plan --params-b 235 --hosts 16 --link-gb-per-s 50 [--topology tree --fanout 2]
    python -m tpusync.weights demo --hosts 3 --mib 256 [--topology tree --fanout 2]
    python -m tpusync.weights receive --control-socket SOCK --host ADDR --model M --version V \
        --source ADDR [--source ADDR ...] --destination ADDR [--destination ADDR ...] [--topology ...]

`receive` checks every argument before it waits: each address is host:port and given once,
--host is one of the destinations (not a source) and this host's sidecar reaches it, and the
version is >= 1 (tpusync.weights.keys.check_version, the rule of the whole weight API).

`demo` starts one sidecar per simulated host on 127.0.0.1 (host 0 is the trainer's),
publishes random bf16 weights, sends them to every other host with a rich progress bar per
host, checks a sampler on the last host received them byte for byte, and prints metrics.
Errors are one line; --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

from tpusync import cli, errors
from tpusync.weights import plan as planmod
from tpusync.weights.keys import check_version
from tpusync.weights.receive import check_hosts

MIB = 1 << 20


def cmd_plan(args: argparse.Namespace) -> int:
    total = int(args.params_b * 1e9 * args.bytes_per_param)
    p = planmod.predict(total, args.hosts, link_bytes_per_s=args.link_gb_per_s * 1e9, chunk_bytes=args.chunk_mib * MIB,
                        topology=args.topology, fanout=args.fanout)
    print(f"{args.params_b:g}B params x {args.bytes_per_param} B = {total / 1e9:.1f} GB to {args.hosts} hosts "
          f"at {args.link_gb_per_s:g} GB/s per link, {args.topology}"
          f"{f' fan-out {args.fanout}' if args.topology == planmod.TREE else ''}, {args.chunk_mib} MiB chunks:")
    print(f"  plan:  {p.seconds:.2f} s (depth {p.depth}, {p.link_copies} copies on the busiest uplink)")
    print(f"  naive: {p.naive_seconds:.2f} s (the trainer sends every host its own copy)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from tpusync import KVStore
    from tpusync.local import sidecars as sidecar
    from tpusync.weights import VersionedWeights, WeightDistributor

    console = Console()
    workdir = tempfile.mkdtemp(prefix="tpusync-weights-demo-")
    secret = os.path.join(workdir, "secret")
    sidecar.write_secret(secret, os.urandom(32).hex())
    total = args.mib * MIB
    cars = []
    try:
        for i in range(args.hosts):
            pool = f"/dev/shm/tpusync-wdemo-{os.getpid()}-{i}-{uuid.uuid4().hex[:6]}"
            car = sidecar.launch(pool_path=pool, secret_file=secret, dram_bytes=2 * total + 64 * MIB,
                                 block_bytes=4 * MIB, control_socket=os.path.join(workdir, f"h{i}.sock"),
                                 stderr=subprocess.DEVNULL)
            cars.append(car)
        rng = np.random.default_rng(0)
        leaf = 8 * MIB // 2
        params = {f"layer{i:03d}": jnp.asarray(rng.standard_normal(leaf, np.float32).astype(ml_dtypes.bfloat16))
                  for i in range(max(1, total // (8 * MIB)))}
        trainer = VersionedWeights(KVStore.connect(f"unix://{cars[0].control_socket}"), "demo", blocks_per_chunk=4)
        m = trainer.publish(params, 1)
        console.print(f"published version 1: {m.nbytes / MIB:.0f} MiB, {len(m.blocks())} blocks, "
                      f"{len(m.chunks())} chunks on host 0 ({cars[0].address})")
        mgr = WeightDistributor(topology=args.topology, fanout=args.fanout)
        mgr.register_work_unit("trainer", host=cars[0].address, control_socket=cars[0].control_socket, role="trainer")
        for i, car in enumerate(cars[1:], 1):
            mgr.register_work_unit(f"sampler-{i}", host=car.address, control_socket=car.control_socket)
        columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn()]
        with Progress(*columns, console=console) as progress:
            tasks = {car.address: progress.add_task(f"host {i} {car.address}", total=m.nbytes)
                     for i, car in enumerate(cars[1:], 1)}
            report = mgr.transfer(["trainer"], None, "demo",
                                  on_chunk=lambda host, done, n, nbytes: progress.advance(tasks[host], nbytes))
        console.print(f"{args.topology}: {len(report.committed)} hosts committed in {report.seconds:.3f} s "
                      f"({m.nbytes * len(report.committed) / report.seconds / 1e9:.2f} GB/s delivered); "
                      f"failed: {report.failed or 'none'}")
        sampler = VersionedWeights(KVStore.connect(f"unix://{cars[-1].control_socket}"), "demo")
        sampler.bind_weights(params)
        sampler.wait_for_version(1, timeout=60)
        same = all(np.asarray(params[k]).tobytes() == np.asarray(sampler.params[k]).tobytes() for k in params)
        console.print(f"sampler on host {len(cars) - 1}: version {sampler.version}, byte-exact: {same}")
        metrics = sampler.get_metrics()
        console.print({k: metrics[k] for k in ("version", "bytes_loaded", "last_load_seconds", "zero_copy_leaves")})
        console.print({k: v for k, v in mgr.get_metrics().items() if k != "hosts"})
        mgr.close()
        return 0 if same and report.ok else 1
    finally:
        for car in cars:
            car.kill()
            car.remove_pool()
        shutil.rmtree(workdir, ignore_errors=True)


def cmd_receive(args: argparse.Namespace) -> int:
    """One host's end of a transfer: every destination host runs this with the same arguments
    (but its own --host and --control-socket); see tpusync/weights/receive.py."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from tpusync import KVStore
    from tpusync.weights.receive import receive_version

    console = Console(stderr=True)
    with KVStore.connect(f"unix://{args.control_socket}") as store, \
            Progress(TextColumn(f"v{args.version} -> {args.host} chunks"), BarColumn(), MofNCompleteColumn(),
                     console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("", total=None)

        def landed(done: int, n: int, nbytes: int) -> None:
            progress.update(task, total=n, completed=done)
            print(f"chunk {done}/{n}", flush=True)   # one line per chunk on stdout, for scripts

        report = receive_version(
            store, args.model, args.version, host=args.host, sources=args.source, destinations=args.destination,
            topology=args.topology, fanout=args.fanout, timeout=args.timeout_seconds, stall_seconds=args.stall_seconds,
            on_chunk=landed)
    print(f"committed version {report.version} of {report.model!r}: {report.bytes} bytes in "
          f"{report.seconds:.3f} s; rerouted: {report.rerouted or 'none'}", flush=True)
    return 0


def version_arg(text: str) -> int:
    """An argparse type: a weight version, by the API's own rule (keys.check_version)."""
    try:
        return check_version(int(text))
    except errors.InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


RECEIVE_FLAGS = ("--host", "--source", "--destination")


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, "python -m tpusync.weights", argv)


def _main(argv: list[str]) -> int:
    count, size = cli.positive(int), cli.positive(float)
    ap = argparse.ArgumentParser(prog="python -m tpusync.weights", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="predict a transfer's time from the plan")
    p.add_argument("--params-b", type=size, default=235.0, help="parameters, in billions")
    p.add_argument("--bytes-per-param", type=count, default=2)
    p.add_argument("--hosts", type=count, default=16)
    p.add_argument("--link-gb-per-s", type=size, default=50.0, help="GB/s per host link (gigabytes)")
    p.add_argument("--chunk-mib", type=count, default=64)
    d = sub.add_parser("demo", help="run a transfer between local sidecars with a progress bar")
    d.add_argument("--hosts", type=count, default=3)
    d.add_argument("--mib", type=count, default=256)
    r = sub.add_parser("receive", help="land a version on this host along the plan and commit it")
    r.add_argument("--control-socket", required=True, help="this host's sidecar control socket")
    r.add_argument("--host", required=True, help="this host's data address, as in --destination")
    r.add_argument("--model", required=True)
    r.add_argument("--version", type=version_arg, required=True, help="the version to receive, >= 1")
    r.add_argument("--source", action="append", required=True,
                   help="a trainer host's data address (several: every host of the trainer, in process order)")
    r.add_argument("--destination", action="append", required=True, help="every destination host, in plan order")
    r.add_argument("--timeout-seconds", type=size, default=300.0)
    r.add_argument("--stall-seconds", type=size, default=30.0)
    for q in (p, d, r):
        q.add_argument("--topology", choices=[planmod.CHAIN, planmod.TREE], default=planmod.CHAIN)
        q.add_argument("--fanout", type=count, default=2)
        cli.add_debug(q)
    args = ap.parse_args(argv)
    if args.cmd == "receive":   # before anything connects or waits
        try:
            args.host, args.source, args.destination = check_hosts(args.host, args.source, args.destination,
                                                                   names=RECEIVE_FLAGS)
        except errors.InvalidArgumentError as e:
            r.error(str(e))
    return {"plan": cmd_plan, "demo": cmd_demo, "receive": cmd_receive}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
