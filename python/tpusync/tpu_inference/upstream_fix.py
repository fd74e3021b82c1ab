"""Alias: kv_connector_module_path "tpusync.tpu_inference.upstream_fix" (`tpusync.engines.tpu_inference`)."""
from tpusync.engines.tpu_inference.upstream_fix import TPUConnector

__all__ = ["TPUConnector"]
