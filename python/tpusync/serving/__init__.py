"""tpusync.serving: a small JAX model server (prefill / decode / both) on the tpusync data path."""

from tpusync.serving.engine import Engine, Result
from tpusync.serving.model import ModelConfig

__all__ = ["Engine", "ModelConfig", "Result"]
