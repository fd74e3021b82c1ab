"""python -m tpusync.serving --role prefill|decode|both --port 8000 [...]"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from tpusync import cli, errors
from tpusync.engines.reference.engine import ROLES, Engine
from tpusync.engines.reference.model import ModelConfig
from tpusync.engines.reference.server import BODY_BYTES_PER_TOKEN, DEFAULT_MAX_BODY_BYTES, CompletionServer
from tpusync.engines.reference.slice import Slice, SliceConfig
from tpusync.store import KVStore

log = logging.getLogger("tpusync.serving")
# How long a stopping server lets its requests in flight finish: within the 60 s grace period the
# operator gives engine pods, after their 5 s preStop drain.
STOP_DRAIN_SECONDS = 50.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tpusync.serving", description=__doc__)
    ap.add_argument("--role", choices=ROLES, default="both")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--model", default="tpusync/reference", help="model name (the reference engine ignores URIs)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--control-socket", default=None, help="the pod's sidecar control socket (unix path)")
    ap.add_argument("--data-address", default=None, help="host:port of that sidecar's data port, for P/D params")
    ap.add_argument("--peers", default="", help="comma-separated sidecar data addresses to look for prefixes")
    ap.add_argument("--embedded-store-bytes", type=int, default=0,
                    help="without a sidecar: an in-process DRAM store of this size (0: no prefix cache)")
    ap.add_argument("--no-prefix-cache", action="store_true", help="always compute the whole prompt")
    ap.add_argument("--hash-seed", default="tpusync")
    ap.add_argument("--kv-events-endpoint", default=None, help='publish KV events here, e.g. "tcp://*:5557"')
    ap.add_argument("--kv-events-topic", default=None, help="default: kv@<host>:<port>@<model>")
    ap.add_argument("--kv-events-audit-s", type=float, default=2.0,
                    help="how often to ask the store where every announced block is (0: never): a backstop; "
                         "its change feed reports demotions and evictions as they happen, and what other hosts "
                         "publish on or remove from the shared tier at each of the sidecar's scans")
    ap.add_argument("--model-config", default="{}", help="JSON overrides of ModelConfig fields")
    ap.add_argument("--max-prompt-tokens", type=cli.positive(int), default=None,
                    help="the longest prompt any route takes, /v1/completions/render included; longer ones get 400 "
                         "before they are tokenised (default: the model's max_seq)")
    ap.add_argument("--max-body-bytes", type=cli.positive(int), default=None,
                    help="the largest request body; larger ones get 413 before they are read (default: "
                         f"{DEFAULT_MAX_BODY_BYTES >> 20} MiB, or {BODY_BYTES_PER_TOKEN} bytes a prompt token if "
                         "that is more)")
    ap.add_argument("--no-warm-up", action="store_true")
    mh = ap.add_argument_group("multi-host slice", "one process per host, all started with the same flags but "
                                                   "--process-id and their host's --control-socket/--data-address; "
                                                   "process 0 serves HTTP")
    mh.add_argument("--num-processes", type=cli.positive(int), default=1)
    mh.add_argument("--process-id", type=int, default=0)
    mh.add_argument("--coordinator", default=None, help="host:port of process 0's coordination service")
    mh.add_argument("--cpu-devices", type=int, default=0, help="on the CPU: JAX devices per process")
    cli.add_debug(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return cli.run(_main, "python -m tpusync.serving", argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="ts=%(created).6f level=%(levelname)s msg=%(message)s")
    group = None
    if args.num_processes > 1:  # before anything else starts JAX
        if not args.coordinator:
            raise errors.InvalidArgumentError("--num-processes > 1 needs --coordinator host:port")
        group = Slice(SliceConfig(args.coordinator, args.num_processes, args.process_id, args.cpu_devices))
    cfg = ModelConfig(**json.loads(args.model_config))
    store = None
    if args.control_socket:
        store = KVStore.connect(f"unix://{args.control_socket}")
    elif args.embedded_store_bytes:
        store = KVStore.local(dram_bytes=args.embedded_store_bytes, block_bytes=-(-cfg.page_bytes // 4096) * 4096)
    events = feed = None
    if args.kv_events_endpoint and (group is None or group.leader):  # a slice's leader announces for it
        from tpusync.kv.events import KVEventPublisher

        events = KVEventPublisher(args.kv_events_endpoint, args.kv_events_topic or "kv@")
        # The store's change feed, on a connection of its own (its long poll holds it); a slice's
        # leader audits every host's sidecar in lockstep instead.
        if group is None:
            feed = KVStore.connect(f"unix://{args.control_socket}") if args.control_socket else store
    engine = Engine(cfg, role=args.role, store=store, data_address=args.data_address,
                    peers=[p for p in args.peers.split(",") if p], hash_seed=args.hash_seed,
                    prefix_cache=not args.no_prefix_cache, kv_events=events,
                    kv_events_audit_s=args.kv_events_audit_s, kv_events_feed=feed, slice=group, model=args.model,
                    reconnect=(lambda: KVStore.connect(f"unix://{args.control_socket}")) if args.control_socket
                    else None)
    if not args.no_warm_up:
        engine.warm_up()  # on a slice, every process compiles the same computations in lockstep
    if group is not None and not group.leader:
        print(json.dumps({"event": "ready", "process": args.process_id}), flush=True)
        engine.follow_leader()
        return 0
    if group is not None:
        threading.Thread(target=engine.keep_slice_alive, daemon=True, name="slice-keepalive").start()
    server = CompletionServer((args.host, args.port), engine, args.served_model_name or args.model,
                              max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens)
    port = server.server_address[1]
    ready = {"event": "ready", "port": port, "role": args.role}
    if events is not None:
        if not args.kv_events_topic:
            # llm-d names a pod by the address and port it routes to, and hashes the model name
            # into every block key: both must be the ones requests use.
            host = os.environ.get("POD_IP", args.host)
            events.topic = f"kv@{host}:{port}@{args.served_model_name or args.model}".encode()
        ready["kv_events_endpoint"] = events.endpoint
    # SIGTERM (the kubelet's stop, after the pod's preStop drain took it out of its Services):
    # no new connection, the requests in flight finish, then exit 0. As a container's PID 1 the
    # process would otherwise ignore SIGTERM and be killed at the end of the grace period.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, name="stop").start())
    print(json.dumps(ready), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if not server.drain(STOP_DRAIN_SECONDS):
            log.warning("stopping with requests still being answered after %ss", STOP_DRAIN_SECONDS)
        if group is not None:
            engine.stop_slice()
    return 0


if __name__ == "__main__":
    sys.exit(main())
