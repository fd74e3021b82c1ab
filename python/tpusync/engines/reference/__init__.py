"""tpusync.serving: a small JAX model server (prefill / decode / both) on the tpusync data path."""

from tpusync.engines.reference.engine import Engine, Result
from tpusync.engines.reference.model import ModelConfig

__all__ = ["Engine", "ModelConfig", "Result"]
