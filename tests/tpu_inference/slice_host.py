"""One host of a simulated multi-host tpu-inference slice: a JAX process of a multi-process
program on the CPU (jax.distributed, gloo), whose KV cache is made by tpu-inference's own code
(its 2D mesh, with the CPU shim's device order, and `create_kv_caches`: one global array per
layer sharded over the kv heads of every device of every host), running the worker half of
tpusync's connector against its own sidecar.

The test (`test_multihost_connector.py`) is the engine core: it sends every host the same step,
as tpu-inference's Ray executor does, and merges their outputs with vLLM's KVOutputAggregator.
A step: the connector's start_load_kv, then the "forward" (the pages of the prompt that were not
loaded are written with the KV `expected_kv` gives their tokens), then wait_for_save.

Commands and replies are pickled, one per line of hex, on stdin and stdout.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from types import SimpleNamespace

import numpy as np


def expected_kv(tokens: list[int], layers: int, page_tokens: int, width: tuple[int, ...]) -> np.ndarray:
    """The KV every engine computes for a prompt's positions: [layers, positions, *width], each
    position's values a function of the tokens up to it (as attention's K and V are)."""
    out = np.empty((layers, len(tokens)) + width, np.float32)
    size = int(np.prod(width))
    prefix = 0
    for t, token in enumerate(tokens):
        prefix = (prefix * 1000003 + token + 1) % 2147483647
        for layer in range(layers):
            rng = np.random.default_rng([prefix, layer])
            out[layer, t] = rng.integers(-64, 64, size).reshape(width) / 8.0  # exact in bfloat16
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--control-socket", required=True)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax.numpy as jnp

    import tpusync_cpu_shim  # vLLM loads it as a plugin in an engine's processes; nothing here does

    tpusync_cpu_shim.register()
    from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES_2D
    from tpu_inference.runner.kv_cache import create_kv_caches
    from tpu_inference.utils import make_optimized_mesh

    from tpusync.engines.connector.config import ConnectorConfig
    from tpusync.engines.tpu_inference.worker import JaxWorkerSide

    devices = jax.devices()
    mesh = make_optimized_mesh((1, len(devices)), MESH_AXIS_NAMES_2D, devices=devices)
    names = [f"layer.{i}" for i in range(args.layers)]
    runner = SimpleNamespace(kv_caches=create_kv_caches(args.pages, args.page_tokens, args.kv_heads, args.head_dim,
                                                        mesh, names, cache_dtype=jnp.bfloat16))
    width = runner.kv_caches[0].shape[2:]
    cfg = ConnectorConfig(control_socket=args.control_socket, store="sidecar", retry_s=0.0, timeout_s=10.0)
    worker = JaxWorkerSide(cfg, len(devices), args.num_processes)
    worker.register_runner(runner)

    @jax.jit
    def write(layers, values, page_ids):  # the "forward": the same program on every host
        return [layer.at[page_ids].set(v) for layer, v in zip(layers, values)]

    def forward(tokens: list[int], pages: list[int], first_page: int) -> None:
        todo = pages[first_page:]
        if not todo:
            return
        kv = expected_kv(tokens[:len(pages) * args.page_tokens], args.layers, args.page_tokens, width)
        values = [jnp.asarray(kv[layer].reshape((len(pages), args.page_tokens) + width)[first_page:], jnp.bfloat16)
                  for layer in range(args.layers)]
        runner.kv_caches = write(runner.kv_caches, values, jnp.asarray(todo, jnp.int32))

    def reply(value: object) -> None:
        sys.stdout.write(pickle.dumps(value).hex() + "\n")
        sys.stdout.flush()

    reply({"ready": jax.process_index(), "shards": worker.local_shards})
    for line in sys.stdin:
        cmd = pickle.loads(bytes.fromhex(line.strip()))
        if cmd["op"] == "step":
            meta = cmd["meta"]
            worker.start_load(meta)
            for tokens, pages, first in cmd["compute"]:
                forward(tokens, pages, first)
            worker.wait_for_save(meta)
            reply({"meta": worker.take_worker_meta(), "errors": worker.take_errors()})
        elif cmd["op"] == "wait_probes":  # the probe thread's work, done before the next step
            if worker.slice is not None:
                worker.slice.pool.submit(lambda: None).result()
            reply({})
        elif cmd["op"] == "pages":  # this host's shards of these pages: {shard: [layers, pages, ...]}
            out = {}
            for layer in runner.kv_caches:
                shard_shape = layer.sharding.shard_shape(layer.shape)
                for s in layer.addressable_shards:
                    n = (s.index[2].start or 0) // shard_shape[2]
                    out.setdefault(n, []).append(np.asarray(s.data[np.asarray(cmd["pages"])], np.float32))
            reply({n: np.stack(v) for n, v in out.items()})
        elif cmd["op"] == "stop":
            worker.shutdown()
            reply({})
            break
    os._exit(0)  # jax.distributed's shutdown barrier would wait on hosts that already left


if __name__ == "__main__":
    main()
