"""Benchmarks of decode (bench/README.md)."""
