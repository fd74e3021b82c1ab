"""Alias of `tpusync.engines.vllm` for the paths users type into vLLM configs (module paths, --middleware)."""
