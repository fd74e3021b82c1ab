"""The test tiers. A package so that `harness` is this repository's, wherever Python
looks (some environments ship a top-level `tests` package of their own)."""
