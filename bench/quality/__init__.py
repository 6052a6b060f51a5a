"""Benchmarks of quality (bench/README.md)."""
