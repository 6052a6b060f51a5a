"""Benchmarks of import hf (bench/README.md)."""
