"""A trainer that pauses a vLLM server, then publishes a checkpoint, and is killed meanwhile.

    python pausing_trainer_proc.py SERVER_URL CONTROL_SOCKET MODEL CHECKPOINT_DIR VERSION STOP_AFTER_BLOCKS

It POSTs SERVER_URL/pause?mode=wait, publishes, and after STOP_AFTER_BLOCKS blocks prints
"mid-publish" and waits on stdin, for the test to SIGKILL it there: nothing resumes the server.
"""

from __future__ import annotations

import sys
import urllib.request

import torch
from transformers import Qwen3ForCausalLM

from tpusync import KVStore, VersionedWeights


def main() -> int:
    url, socket, model, checkpoint = sys.argv[1:5]
    version, stop_after = int(sys.argv[5]), int(sys.argv[6])
    params = dict(Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).named_parameters())
    with urllib.request.urlopen(urllib.request.Request(f"{url}/pause?mode=wait", b"", method="POST"), timeout=300):
        pass

    def on_block(done: int, total: int) -> None:
        if done == stop_after:
            print("mid-publish", flush=True)
            sys.stdin.read()  # until killed

    VersionedWeights(KVStore.connect(f"unix://{socket}"), model).publish(params, version, on_block=on_block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
