"""Alias: the entry point installs made before issue 42 recorded (now `tpusync.engines.vllm.plugin`)."""
from tpusync.engines.vllm.plugin import register

__all__ = ["register"]
