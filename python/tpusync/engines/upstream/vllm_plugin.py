"""vLLM's general-plugin hook for upstream TPU Sync's module paths: entry point `tpusync-upstream`
in `vllm.general_plugins` (pyproject.toml), beside the weight-transfer backend's `tpusync`.

vLLM loads every plugin of the group in each of its processes (API server, engine core,
workers; VLLM_PLUGINS, when set, must name it). With TPUSYNC_UPSTREAM_API=1 this serves
upstream's paths from tpusync.engines.upstream there, so the engines' own TPU Sync
integrations (tpu-inference's RaidenOffloadConnector) run on tpusync; otherwise it does
nothing. An entry point of its own keeps vLLM's plugin and the upstream API apart: neither
imports the other.
"""

from __future__ import annotations

import logging

from tpusync.engines import upstream


def register() -> None:
    try:
        upstream.install_if_enabled()
    except upstream.UpstreamInstalled as e:  # upstream's own package serves its consumers: say so, go on
        logging.getLogger("tpusync").error("%s=1 ignored: %s", upstream.ENV, e)
