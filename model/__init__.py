"""A Reformer language model for long documents: LSH and local attention, reversible layers. Cached decoding is
model.decoding; the C kernels model.kernels."""

from .config import ReformerConfig
from .reformer import ReformerLM, ReformerOutput
from .tokenizer import ByteTokenizer, IncrementalDecoder

__all__ = ["ByteTokenizer", "IncrementalDecoder", "ReformerConfig", "ReformerLM", "ReformerOutput"]
