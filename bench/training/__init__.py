"""Benchmarks of training (bench/README.md)."""
