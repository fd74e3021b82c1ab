"""The test tiers. A package so that `tests.support` is this repository's, wherever Python
looks (some environments ship a top-level `tests` package of their own)."""
