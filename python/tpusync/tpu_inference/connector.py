"""Alias: kv_connector_module_path "tpusync.tpu_inference.connector" (`tpusync.engines.tpu_inference.connector`)."""
from tpusync.engines.tpu_inference.connector import TPUConnector, TPUSyncConnector

__all__ = ["TPUConnector", "TPUSyncConnector"]
