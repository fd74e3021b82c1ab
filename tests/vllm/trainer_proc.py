"""A torch trainer process that publishes a checkpoint's weights as one version, and can die.

    python trainer_proc.py CONTROL_SOCKET MODEL CHECKPOINT_DIR VERSION [DIE_AFTER_BLOCKS]

With DIE_AFTER_BLOCKS it exits (os._exit, as a killed process would: nothing cleaned up)
after storing that many blocks, before the manifest and the commit record.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import Qwen3ForCausalLM

from tpusync import KVStore, VersionedWeights


def main() -> int:
    socket, model, checkpoint, version = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    die_after = int(sys.argv[5]) if len(sys.argv) > 5 else None
    params = dict(Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).named_parameters())

    def on_block(done: int, total: int) -> None:
        if die_after is not None and done >= die_after:
            os._exit(9)

    VersionedWeights(KVStore.connect(f"unix://{socket}"), model).publish(params, version, on_block=on_block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
