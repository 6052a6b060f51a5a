"""Benchmarks of the exported graphs (bench/README.md)."""
