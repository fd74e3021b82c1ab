"""Alias: kv_connector_module_path "tpusync.vllm.connector" (`tpusync.engines.vllm.connector`)."""
from tpusync.engines.vllm.connector import TPUSyncConnector

__all__ = ["TPUSyncConnector"]
