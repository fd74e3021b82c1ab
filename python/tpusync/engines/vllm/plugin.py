"""vLLM's general-plugin hook, entry point `tpusync` in `vllm.general_plugins` (pyproject.toml).

vLLM calls `register` in each of its processes (API server, engine core, workers), and a
trainer that drives engines through the trainer factory calls it too. It registers the
`tpusync` weight-transfer backend by name only: nothing is imported until an engine asks
for it with --weight-transfer-config '{"backend": "tpusync"}'. Upstream TPU Sync's module paths
have an entry point of their own (tpusync.engines.upstream.vllm_plugin).
"""

from __future__ import annotations

import contextlib

BACKEND = "tpusync"
MODULE = "tpusync.engines.vllm.weight_transfer"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, "TpusyncWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "TpusyncTrainerWeightTransferEngine")):
        with contextlib.suppress(ValueError):  # registered already in this process
            factory.register_engine(BACKEND, MODULE, cls)
