"""A Reformer language model for long documents: LSH and local attention, reversible layers."""

from .config import ReformerConfig
from .decode import DecodeState
from .reformer import ReformerLM, ReformerOutput
from .tokenizer import ByteTokenizer, IncrementalDecoder

__all__ = ["ByteTokenizer", "DecodeState", "IncrementalDecoder", "ReformerConfig", "ReformerLM", "ReformerOutput"]
