"""Benchmarks of prefill (bench/README.md)."""
