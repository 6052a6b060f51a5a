"""The PyTorch reference of each LSH primitive, used by the forward, the ONNX graph, the sliced prefill and the
decode paths (docs/ARCHITECTURE.md lists every place and its test):

- hashing.py: the rotations, the bucket count, each position's bucket;
- order.py: each round's positions sorted by (bucket, position);
- windows.py: chunking with look-back (the chunks each chunk attends to, and their key windows);
- masks.py: the mask values and the additive bias of a window;
- successor.py: successor-value heads (key s contributes the value of position s+1).
"""

from .successor import no_key_threshold, successor_values, zero_rows_without_keys

__all__ = ["no_key_threshold", "successor_values", "zero_rows_without_keys"]
