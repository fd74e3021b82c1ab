"""`tpu_raiden`: the top-level names upstream's consumers fall back to."""

from tpusync.engines.upstream.kv_cache_manager import KVCacheManager
from tpusync.engines.upstream.kv_cache_store import KVCacheStore, RaidenId

__all__ = ["KVCacheManager", "KVCacheStore", "RaidenId"]
