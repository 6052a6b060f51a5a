"""Benchmarks of serving (bench/README.md)."""
