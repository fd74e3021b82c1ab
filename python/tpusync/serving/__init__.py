"""Alias: `python -m tpusync.serving` starts the reference engine, `tpusync.engines.reference`."""
