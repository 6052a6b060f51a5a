"""Benchmarks of gpu (bench/README.md)."""
