"""The PyTorch reference of each LSH primitive, used by the forward, the ONNX graph, the sliced prefill and the
decode paths (docs/ARCHITECTURE.md lists every place and its test)."""

from .successor import no_key_threshold, successor_values, zero_rows_without_keys

__all__ = ["no_key_threshold", "successor_values", "zero_rows_without_keys"]
