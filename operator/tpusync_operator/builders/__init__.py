"""Pure builders: build_<child>(spec, ...) -> dict. No I/O, no clock, no randomness."""
