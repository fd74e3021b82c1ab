"""Alias of `tpusync.engines.tpu_inference` for the kv_connector_module_path values users type."""
