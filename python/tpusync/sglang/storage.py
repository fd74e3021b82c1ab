"""Alias: SGLang's module_path "tpusync.sglang.storage"; the module is `tpusync.engines.sglang.storage`."""
from tpusync.engines.sglang.storage import TPUSyncHiCacheStorage

__all__ = ["TPUSyncHiCacheStorage"]
