"""Alias of `tpusync.engines.sglang` for the module_path users type into SGLang's extra config."""
