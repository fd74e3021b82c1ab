"""One process of a 2-process JAX trainer on the CPU (jax.distributed, gloo), for the
multi-host weight tests. Each process holds half of the sharded leaves' shards.

    python -m tests.integration.weights.trainer_mp SOCK COORDINATOR PROCESS_ID VERSION SEED [STOP_AT]

publishes the test model as VERSION (its part) and prints "COMMITTED"; with STOP_AT prints
"STOPPED" after that many blocks and blocks on stdin (the test kills it there).
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tpusync
from tpusync.weights import VersionedWeights

from .model import host_params

# Rows of embed and head split over the 4 devices (2 per process), layer weights split by
# columns, the int8 vectors replicated (process 0 holds replica 0 and publishes them).
SPECS = {"embed": P("x"), "head": P("x"), "w": P(None, "x"), "n": P()}


def main(argv: list[str]) -> None:
    sock, coordinator, pid, version, seed = argv[:5]
    stop_at = int(argv[5]) if len(argv) > 5 else None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Bound where it is reached: JAX's default is every address ([::]).
    jax.distributed.initialize(coordinator, num_processes=2, process_id=int(pid), coordinator_bind_address=coordinator)
    mesh = Mesh(np.array(jax.devices()).reshape(4), ("x",))

    def place(path, host):
        spec = SPECS[str(getattr(path[-1], "key", ""))] if hasattr(path[-1], "key") else P()
        return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])

    params = jax.tree_util.tree_map_with_path(place, host_params(int(seed)))

    def on_block(done: int, total: int) -> None:
        if done == stop_at:
            print("STOPPED", flush=True)
            sys.stdin.read()

    VersionedWeights(tpusync.KVStore.connect(f"unix://{sock}"), "m", blocks_per_chunk=4).publish(
        params, int(version), on_block=on_block)
    print("COMMITTED", flush=True)
    sys.stdin.read()   # stay: jax.distributed's shutdown waits for the other process


if __name__ == "__main__":
    main(sys.argv[1:])
