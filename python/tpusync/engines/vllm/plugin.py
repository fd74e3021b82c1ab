"""vLLM's general-plugin hook, entry point `tpusync` in `vllm.general_plugins` (pyproject.toml).

vLLM calls `register` in each of its processes (API server, engine core, workers), and a
trainer that drives engines through the trainer factory calls it too. It registers the
`tpusync` weight-transfer backend by name only: nothing is imported until an engine asks
for it with --weight-transfer-config '{"backend": "tpusync"}'. With TPUSYNC_UPSTREAM_API=1 it
also serves upstream TPU Sync's module paths from tpusync (`tpusync.engines.upstream`), so the engines'
own TPU Sync integrations (tpu-inference's RaidenOffloadConnector) run on tpusync.
"""

from __future__ import annotations

import contextlib
import logging

BACKEND = "tpusync"
MODULE = "tpusync.engines.vllm.weight_transfer"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from tpusync.engines import upstream

    try:
        upstream.install_if_enabled()
    except upstream.UpstreamInstalled as e:  # upstream's own package serves its consumers: say so, go on
        logging.getLogger("tpusync").error("%s=1 ignored: %s", upstream.ENV, e)

    for factory, cls in ((WeightTransferEngineFactory, "TpusyncWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "TpusyncTrainerWeightTransferEngine")):
        with contextlib.suppress(ValueError):  # registered already in this process
            factory.register_engine(BACKEND, MODULE, cls)
