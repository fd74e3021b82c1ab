"""Test support shared by the test tiers and the benchmarks (bench/ imports it as tests.support)."""
