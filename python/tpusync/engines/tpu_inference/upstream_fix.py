"""tpu-inference 0.32.0's TPUConnector with the one-line fix for vLLM 0.32.

The defect: the decode side reports its pulls as asynchronous (`get_num_new_matched_tokens`
returns `(n, True)`) and, once a pull is done, inserts the pulled KV into the cache inside
`start_load_kv` of the step that first schedules the request. vLLM 0.32 calls `start_load_kv`
*after* the forward pass unless `scheduler_output.has_sync_kv_loads` is set
(vllm/v1/worker/kv_connector_model_runner_mixin.py, `_get_kv_connector_output`), and the
scheduler sets that flag only for synchronous loads (vllm/v1/core/sched/scheduler.py). So the
forward that computes the prompt's last tokens reads KV pages that are not there yet, and the
decode tokens are wrong. The fix: mark the step's loads synchronous whenever the connector
hands the worker requests to load or insert, as vLLM's own HiSparse connector does.

The class keeps upstream's name: tpu-inference's platform accepts only the kv_connector names
TPUConnector, TPUConnectorHMA, TPUOffloadConnector and RaidenOffloadConnector
(platforms/tpu_platform.py, check_and_update_config), and vLLM takes the class of that name
from `kv_connector_module_path` when one is given (kv_connector/factory.py).
"""

from __future__ import annotations

from typing import Any

from tpu_inference.distributed import tpu_connector as upstream


class TPUConnector(upstream.TPUConnector):
    def build_connector_meta(self, scheduler_output: Any) -> upstream.TPUConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        if meta.reqs_to_load:
            scheduler_output.has_sync_kv_loads = True  # insert before this step's forward
        return meta
