"""Benchmarks of forward (bench/README.md)."""
