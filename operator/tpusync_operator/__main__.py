"""python -m tpusync_operator: run the operator (kopf) with probes, metrics and peering.

  validate FILE...        check the TPUSyncPool and DisaggregatedServing objects in FILEs as
                          the API server and the operator would (the CRDs' schema and CEL
                          rules, unknown fields refused), print every error, and exit: 0
                          valid, 1 errors, 3 a serving's pool neither in FILEs nor in a
                          cluster (--cluster), so the checks that need it were not run
  render FILE...          validate, then print the objects the operator would create for
                          them, without a cluster (see render.py), and exit

  --standalone            no peering (a single replica; dev and tests)
  --peering NAME          ClusterKopfPeering name (default tpusync-operator); two replicas
                          elect one active instance
  --priority N|auto       peering priority; "auto" draws a random one per process, so that
                          replicas of one Deployment differ (kopf pauses every peer when two
                          share the highest priority)
  --namespace NS          watch only these namespaces (repeatable); default cluster-wide
  --liveness URL          kopf probe endpoint (default http://0.0.0.0:8080/healthz); use it
                          for both liveness and readiness: it answers once startup is done
  --metrics-port PORT     Prometheus metrics (default 9090; 0 disables)
  --metrics-address ADDR  address the metrics server binds (default 0.0.0.0, the pod's
                          interfaces; 127.0.0.1 when the operator runs outside a pod)
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys


def _priority(value: str) -> int:
    if value == "auto":
        return random.SystemRandom().randrange(1, 1 << 30)
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


class _QuietWatchHandlers(logging.Filter):
    """kopf logs every successful event handler at INFO; ours (`*_seen`, one per watch event
    of children, pods and nodes) only request a pass, which logs what it does."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Handler '") and "_seen" in msg and msg.endswith("' succeeded."))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["render"], ["validate"]):
        from .render import main as render_main
        return render_main(argv[1:], command=argv[0])
    parser = argparse.ArgumentParser(prog="python -m tpusync_operator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true", help="run without peering")
    mode.add_argument("--peering", default="tpusync-operator", help="ClusterKopfPeering name")
    parser.add_argument("--priority", type=_priority, default=0,
                        help="peering priority: an integer, or 'auto' (random per process)")
    parser.add_argument("--namespace", "-n", action="append", default=[], help="namespace to watch")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="probe endpoint URL")
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("TPUSYNC_METRICS_PORT", "9090")))
    parser.add_argument("--metrics-address", default=os.environ.get("TPUSYNC_METRICS_ADDRESS", "0.0.0.0"))
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kopf.objects").addFilter(_QuietWatchHandlers())
    os.environ["TPUSYNC_METRICS_PORT"] = str(args.metrics_port)
    os.environ["TPUSYNC_METRICS_ADDRESS"] = args.metrics_address
    import kopf

    from .removed_crds import tolerate_removed_crds
    tolerate_removed_crds()
    from . import handlers  # noqa: F401  (registers the handlers with kopf's default registry)

    kopf.run(
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
