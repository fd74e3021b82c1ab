"""tpusync for vLLM on TPU (tpu-inference, JAX KV caches): `tpusync.tpu_inference.connector`.

    --kv-transfer-config '{"kv_connector": "TPUConnector",
                           "kv_connector_module_path": "tpusync.tpu_inference.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"control_socket": "/run/tpusync/control.sock"}}'

The class is exported as `TPUConnector` because tpu-inference 0.32.0 accepts no other
kv_connector names (docs/tpu-inference.md). Importing this package does not import vLLM.
"""
