"""Trainer and sampler processes for the weight tests.

    python -m tests.integration.weights.proc sampler SOCK MODEL VERSION SEED
        binds the test model, waits for VERSION (0: whatever is current), prints
        {"version", "digest"} and stays until stdin closes (so a test can kill it).
    python -m tests.integration.weights.proc trainer SOCK MODEL VERSION SEED [STOP_AT]
        publishes params(SEED) as VERSION; with STOP_AT prints "STOPPED" after that many
        blocks and blocks on stdin (the test kills it there). Prints "COMMITTED" at the end.
"""

from __future__ import annotations

import json
import sys

import tpusync
from tpusync.weights import VersionedWeights

from .model import digest, params


def main(argv: list[str]) -> None:
    role, sock, model, version, seed = argv[:5]
    sync = VersionedWeights(tpusync.KVStore.connect(f"unix://{sock}"), model)
    if role == "sampler":
        sync.bind_weights(params(0))
        got = sync.wait_for_version(int(version), timeout=60) if int(version) else sync.poll()
        print(json.dumps({"version": got, "digest": digest(sync.params)}), flush=True)
        sys.stdin.read()
        return
    stop_at = int(argv[5]) if len(argv) > 5 else None

    def on_block(done: int, total: int) -> None:
        if done == stop_at:
            print("STOPPED", flush=True)
            sys.stdin.read()

    sync.publish(params(int(seed)), int(version), on_block=on_block)
    print("COMMITTED", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
