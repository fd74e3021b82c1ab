"""Operator scale check on the e2e control plane (a benchmark, not a test).

Starts its own control plane (harness/cluster.py: etcd, kube-apiserver, controller-manager,
scheduler, kwok), installs the CRDs and the Helm chart, runs the operator as a process with
the chart's ServiceAccount token (as the e2e suite does), creates one TPUSyncPool and N
DisaggregatedServing objects (reference engine, cpuOnly, routing on: 15 children and 3
kwok pods each) and reports:

- time until all N are Ready (from the moment they were created);
- reconcile latency: create -> first status write (observedGeneration) per object, p50/p99,
  and the operator's own per-pass histogram (tpusync_operator_reconcile_seconds) p50/p99;
- operator CPU seconds (user+system over the run) and peak RSS (VmHWM);
- the baseline, in the same run on the same control plane: the same N servings' objects as the
  operator renders them (`python -m tpusync_operator render`), applied straight with `kubectl
  apply --server-side` into another namespace with no operator, until all their Deployments
  are available. `ratio` = the operator's all-Ready time over that.

    .venv/bin/python bench/operator_bench.py [--count 200]

Needs `make controlplane` (TPUSYNC_CONTROLPLANE_DIR or the pinned cache directory).
Writes bench/results/operator.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml
from rich.console import Console

REPO = Path(__file__).resolve().parents[1]
# Run as `python bench/operator_bench.py`: bench/ is on sys.path (report); the repository
# root goes there too, for harness.
sys.path.insert(0, str(REPO))

from report import report  # noqa: E402

from harness.cluster import Cluster, llmd_objective_crd  # noqa: E402
from harness.operator_process import OperatorProcess, helm_install_operator  # noqa: E402
from harness.polling import wait_for  # noqa: E402
from tpusync_operator.render import render  # noqa: E402

API = "tpusync.dev/v1alpha1"
NS = "bench"
BASELINE_NS = "bench-direct"
NODE_POOL = "bench-cpu"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def histogram_quantile(metrics: str, name: str, kind: str, q: float) -> tuple[float, int]:
    """Prometheus-style quantile from cumulative buckets (linear within a bucket)."""
    buckets: list[tuple[float, float]] = []
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket{{") and f'kind="{kind}"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if not total:
        return 0.0, 0
    rank, prev_le, prev_n = q * total, 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le, int(total)
            return prev_le + (le - prev_le) * (rank - prev_n) / max(n - prev_n, 1e-9), int(total)
        prev_le, prev_n = le, n
    return prev_le, int(total)


def _ts(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def serving(i: int, ns: str = NS) -> dict:
    return {"apiVersion": API, "kind": "DisaggregatedServing",
            "metadata": {"name": f"s{i:04d}", "namespace": ns},
            "spec": {"model": {"name": "m", "uri": "hf://org/m"},
                     "engine": {"type": "reference", "cpuOnly": True},
                     "poolRef": {"name": "pool"}, "prefill": {"replicas": 1},
                     "decode": {"replicas": 1}, "prefixCache": {"hostDram": "1Gi"}}}


def pool_doc(ns: str, hosts: int) -> dict:
    return {"apiVersion": API, "kind": "TPUSyncPool", "metadata": {"name": "pool", "namespace": ns},
            "spec": {"tpu": {"type": "v6e", "topology": "2x2"}, "capacity": {"hosts": hosts},
                     "provisioning": {"mode": "existing", "existing": {"nodePoolName": NODE_POOL}}}}


def baseline_seconds(cl: Cluster, count: int, hosts: int, timeout: float) -> tuple[float | None, int]:
    """(seconds until every Deployment of `count` servings' rendered objects, applied with no
    operator, is available; how many objects that was). Owner references are dropped: their
    owners do not exist here, and the garbage collector would delete what they own."""
    docs = [pool_doc(BASELINE_NS, hosts)] + [serving(i, BASELINE_NS) for i in range(count)]
    objs = []
    for r in render(docs):
        body = r.body
        if any(ref.get("kind") != "DisaggregatedServing" for ref in body["metadata"].get("ownerReferences", [{}])):
            continue    # the pool's objects: the operator's run made its pool before its clock started
        body["metadata"].pop("ownerReferences", None)
        objs.append(body)
    cl.kubectl("create", "namespace", BASELINE_NS)
    t0 = time.monotonic()
    cl.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(objs), timeout=600)
    want = sum(1 for o in objs if o["kind"] == "Deployment")
    while time.monotonic() < t0 + timeout:
        deps = cl.kubectl_json("get", "deployments", "-n", BASELINE_NS)["items"]
        if sum(1 for d in deps if (d.get("status") or {}).get("availableReplicas", 0) >= d["spec"]["replicas"]) == want:
            return time.monotonic() - t0, len(objs)
        time.sleep(1)   # sampling period of the measurement, not synchronisation
    return None, len(objs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "operator.json"))
    ap.add_argument("--keep", action="store_true", help="keep the cluster work directory")
    args = ap.parse_args(argv)
    console = Console()
    load_at_start = round(os.getloadavg()[0], 2)   # other work on the machine skews every figure

    cl = Cluster.create()
    try:
        with cl:
            pods_needed = 2 * 3 * args.count + 10     # the operator's servings, then the baseline's
            nodes = max(1, -(-pods_needed // 250))
            cl.add_cpu_nodes(NODE_POOL, nodes, pods=250)
            cl.install_crds()
            llmd = cl.workdir / "llm-d.ai_inferenceobjectives.yaml"
            llmd.write_text(yaml.safe_dump(llmd_objective_crd(
                cl.crd_dir / "inference.networking.x-k8s.io_inferenceobjectives.yaml")))
            cl.install_crds([llmd])
            cl.kubectl("apply", "-f", str(REPO / "crds"))
            cl.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                       "crd/tpusyncpools.tpusync.dev", "crd/disaggregatedservings.tpusync.dev")
            helm_install_operator(cl, "tpusync-operator", "tpusync-system")
            op = OperatorProcess(cl, service_account="tpusync-operator", namespace="tpusync-system",
                                 workdir=cl.workdir)
            op.start()
            cl.kubectl("create", "namespace", NS)
            cl.apply(pool_doc(NS, nodes))
            wait_for("the pool Ready", lambda: any(
                c["type"] == "Ready" and c["status"] == "True" for c in cl.kubectl_json(
                    "get", "tpusyncpool", "pool", "-n", NS).get("status", {}).get("conditions", [])), 120)

            cpu0 = op.cpu_seconds()
            docs = [serving(i) for i in range(args.count)]
            t0 = time.monotonic()
            cl.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs), timeout=600)
            t_created = time.monotonic() - t0
            ready_at: dict[str, float] = {}
            items: list[dict] = []
            deadline = t0 + args.timeout
            while len(ready_at) < args.count and time.monotonic() < deadline:
                now = time.monotonic() - t0
                items = cl.kubectl_json("get", "disaggregatedservings", "-n", NS)["items"]
                for obj in items:
                    name, st = obj["metadata"]["name"], obj.get("status") or {}
                    if name not in ready_at and any(c["type"] == "Ready" and c["status"] == "True"
                                                    for c in st.get("conditions", [])):
                        ready_at[name] = now
                time.sleep(1)   # sampling period of the measurement, not synchronisation
            all_ready = max(ready_at.values()) if len(ready_at) == args.count else None
            cpu = op.cpu_seconds() - cpu0
            rss = op.peak_rss_bytes()
            metrics = op.metrics()
            p50_pass, passes = histogram_quantile(metrics, "tpusync_operator_reconcile_seconds",
                                                  "DisaggregatedServing", 0.50)
            p99_pass, _ = histogram_quantile(metrics, "tpusync_operator_reconcile_seconds",
                                             "DisaggregatedServing", 0.99)
            # Server-side timestamps (1 s resolution): creation -> first status write (the
            # Degraded condition stays False from the first pass on, so its
            # lastTransitionTime is that pass) and creation -> Ready.
            lat, to_ready = [], []
            for obj in items:
                created = _ts(obj["metadata"]["creationTimestamp"])
                conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}
                if "Degraded" in conds:
                    lat.append(_ts(conds["Degraded"]["lastTransitionTime"]) - created)
                if conds.get("Ready", {}).get("status") == "True":
                    to_ready.append(_ts(conds["Ready"]["lastTransitionTime"]) - created)
            op.stop()
            base_s, base_objs = baseline_seconds(cl, args.count, nodes, args.timeout)
            result = {
                "case": f"{args.count} DisaggregatedServing",
                "count": args.count, "ready": len(ready_at),
                "create_seconds": round(t_created, 1),
                "all_ready_seconds": round(all_ready, 1) if all_ready is not None else None,
                "first_status_p50_s": round(percentile(lat, 50), 2) if lat else None,
                "first_status_p99_s": round(percentile(lat, 99), 2) if lat else None,
                "ready_p50_s": round(statistics.median(to_ready), 1) if to_ready else None,
                "ready_p99_s": round(percentile(to_ready, 99), 1) if to_ready else None,
                "pass_p50_s": round(p50_pass, 3), "pass_p99_s": round(p99_pass, 3),
                "passes": passes, "cpu_seconds": round(cpu, 1),
                "peak_rss_mib": round(rss / 2**20, 1),
                "baseline_all_ready_seconds": round(base_s, 1) if base_s is not None else None,
                "baseline_objects": base_objs,
                "ratio": round(all_ready / base_s, 2) if all_ready is not None and base_s else None,
                "nodes": nodes, "cpus": os.cpu_count(), "load_avg_at_start": load_at_start,
            }
    finally:
        if not args.keep:
            shutil.rmtree(cl.workdir, ignore_errors=True)
    report(console, "tpusync operator at scale (e2e control plane, kwok)", [result], [
        ("case", "case", ""), ("Ready", "ready", "d"), ("all Ready s", "all_ready_seconds", ".1f"),
        ("no operator s", "baseline_all_ready_seconds", ".1f"), ("ratio", "ratio", ".2f"),
        ("1st status p50 s", "first_status_p50_s", ".0f"), ("1st status p99 s", "first_status_p99_s", ".0f"),
        ("Ready p50 s", "ready_p50_s", ".0f"), ("Ready p99 s", "ready_p99_s", ".0f"),
        ("pass p50 s", "pass_p50_s", ".3f"), ("pass p99 s", "pass_p99_s", ".3f"), ("passes", "passes", "d"),
        ("CPU s", "cpu_seconds", ".1f"), ("peak RSS MiB", "peak_rss_mib", ".1f")],
        args.out,
        "all Ready: from the start of `kubectl apply` of all N; 1st status / Ready: per object, "
        "creationTimestamp -> first status write / Ready (server timestamps, 1 s resolution, "
        "queueing behind the other objects included); pass: wall time of one reconcile pass "
        "(operator histogram, bucket-interpolated, top bucket 300 s; passes run concurrently); "
        "Ready follows the workloads' readiness events (kwok pods) through the passes they trigger. "
        "no operator: the same servings' rendered objects applied server-side with no operator, until "
        "every Deployment is available (same control plane, same run); ratio = all Ready s / that.")
    return 0 if len(ready_at) == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
