"""Alias: `--middleware tpusync.vllm.pause_guard.PauseGuard`; the module is `tpusync.engines.vllm.pause_guard`."""
from tpusync.engines.vllm.pause_guard import PauseGuard

__all__ = ["PauseGuard"]
