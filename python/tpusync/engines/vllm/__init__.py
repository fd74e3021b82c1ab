"""tpusync for vLLM: the KV connector `tpusync.vllm.connector.TPUSyncConnector`.

    --kv-transfer-config '{"kv_connector": "TPUSyncConnector",
                           "kv_connector_module_path": "tpusync.vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"control_socket": "/run/tpusync/control.sock"}}'

Importing this package does not import vLLM; `tpusync.vllm.connector` does. Options:
`tpusync.engines.connector.config`; the kv_transfer_params contract: `tpusync.kv.handoff`; usage and what
is tested: docs/vllm.md.
"""

__all__ = ["TPUSyncConnector"]


def __getattr__(name: str) -> type:
    if name == "TPUSyncConnector":
        from tpusync.engines.vllm.connector import TPUSyncConnector

        return TPUSyncConnector
    raise AttributeError(f"module 'tpusync.engines.vllm' has no attribute {name!r}")
