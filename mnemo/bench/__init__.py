"""Benchmarks (scripts that print tables; never asserted in tests)."""
