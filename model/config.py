"""The model's configuration. Field names and meanings follow `transformers.ReformerConfig`, so a
config converts both ways and Google's published Reformer checkpoints load unchanged."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AttnKind = str  # "lsh" | "local"
NumBuckets = int | list[int] | None
SuccessorHeads = int | list[int]

_HF_FIELDS = (
    "attention_head_size", "attn_layers", "axial_norm_std", "axial_pos_embds", "axial_pos_shape",
    "axial_pos_embds_dim", "chunk_size_lm_head", "eos_token_id", "feed_forward_size", "hash_seed",
    "hidden_act", "hidden_dropout_prob", "hidden_size", "initializer_range", "is_decoder", "layer_norm_eps",
    "local_num_chunks_before", "local_num_chunks_after", "local_attention_probs_dropout_prob",
    "local_attn_chunk_length", "lsh_attn_chunk_length", "lsh_attention_probs_dropout_prob",
    "lsh_num_chunks_before", "lsh_num_chunks_after", "max_position_embeddings", "num_attention_heads",
    "num_buckets", "num_hashes", "pad_token_id", "vocab_size", "chunk_size_feed_forward",
)


@dataclass
class ReformerConfig:
    """Hyper-parameters of a Reformer language model (defaults: a small byte-level model)."""

    vocab_size: int = 258
    hidden_size: int = 256
    num_attention_heads: int = 4
    attention_head_size: int = 64
    attn_layers: list[AttnKind] = field(default_factory=lambda: ["local", "lsh", "local", "lsh"])
    feed_forward_size: int = 1024
    hidden_act: str = "relu"
    num_hashes: int = 4
    # int (even), factorised list of even ints, or None: chosen from the (padded) length per call
    num_buckets: NumBuckets = None
    lsh_attn_chunk_length: int = 64
    lsh_num_chunks_before: int = 1
    lsh_num_chunks_after: int = 0
    local_attn_chunk_length: int = 64
    local_num_chunks_before: int = 1
    local_num_chunks_after: int = 0
    axial_pos_embds: bool = True
    axial_pos_shape: tuple[int, int] = (64, 1024)
    axial_pos_embds_dim: tuple[int, int] = (64, 192)
    axial_norm_std: float = 1.0
    max_position_embeddings: int = 65536
    hash_seed: int = 0
    hidden_dropout_prob: float = 0.0
    lsh_attention_probs_dropout_prob: float = 0.0
    local_attention_probs_dropout_prob: float = 0.0
    layer_norm_eps: float = 1e-12
    chunk_size_feed_forward: int = 0
    chunk_size_lm_head: int = 0
    initializer_range: float = 0.02
    is_decoder: bool = True
    pad_token_id: int = 0
    eos_token_id: int = 1
    # not a transformers field: how many heads of each LSH layer read the value of the position after each key
    # (heads 0..k-1; an int for every LSH layer, or one count per LSH layer in order). See `successor_heads`.
    lsh_successor_heads: SuccessorHeads = 0
    # not a transformers field, and an experiment: the width of a causal depthwise convolution on each LSH layer's
    # input before its query/key projection (n-gram keys, model/ngram_keys.py); 0 for none. The PyTorch forward
    # and training only: cached decoding, the C kernels, ONNX and artifacts refuse a model with one.
    lsh_key_conv_width: int = 0

    def __post_init__(self) -> None:
        self.attn_layers = list(self.attn_layers)
        self.axial_pos_shape = tuple(int(v) for v in self.axial_pos_shape)  # type: ignore[assignment]
        self.axial_pos_embds_dim = tuple(int(v) for v in self.axial_pos_embds_dim)  # type: ignore[assignment]
        if isinstance(self.num_buckets, tuple):
            self.num_buckets = list(self.num_buckets)
        if isinstance(self.lsh_successor_heads, tuple):
            self.lsh_successor_heads = list(self.lsh_successor_heads)
        self.validate()

    # ----------------------------------------------------------------------------------------------
    def validate(self) -> None:
        if not self.attn_layers:
            raise ValueError("attn_layers must name at least one layer")
        bad = [k for k in self.attn_layers if k not in ("lsh", "local")]
        if bad:
            raise ValueError(f"attn_layers may only contain 'lsh' and 'local', got {bad}")
        if self.axial_pos_embds:
            if len(self.axial_pos_shape) != 2 or len(self.axial_pos_embds_dim) != 2:
                raise ValueError("axial_pos_shape and axial_pos_embds_dim must have two entries each")
            if sum(self.axial_pos_embds_dim) != self.hidden_size:
                raise ValueError(
                    f"axial_pos_embds_dim {self.axial_pos_embds_dim} must sum to hidden_size {self.hidden_size}"
                )
            if math.prod(self.axial_pos_shape) < self.max_position_embeddings:
                raise ValueError(
                    f"axial_pos_shape {self.axial_pos_shape} covers {math.prod(self.axial_pos_shape)} positions,"
                    f" fewer than max_position_embeddings {self.max_position_embeddings}"
                )
        buckets = self.num_buckets
        if isinstance(buckets, int) and buckets % 2:
            raise ValueError(f"num_buckets must be even, got {buckets}")
        if isinstance(buckets, list) and any(b % 2 for b in buckets):
            raise ValueError(f"every factor of num_buckets must be even, got {buckets}")
        if self.is_decoder and (self.lsh_num_chunks_after or self.local_num_chunks_after):
            raise ValueError("a causal (is_decoder) model cannot look at chunks after the current one")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(_ACTIVATIONS)}, got {self.hidden_act!r}")
        self._validate_successor_heads()
        width = self.lsh_key_conv_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 0:
            raise ValueError(f"lsh_key_conv_width must be an integer >= 0, got {width!r}")

    def _validate_successor_heads(self) -> None:
        counts = self.lsh_successor_heads
        lsh_layers = self.attn_layers.count("lsh")
        if isinstance(counts, list):
            if len(counts) != lsh_layers:
                raise ValueError(f"lsh_successor_heads lists {len(counts)} counts for {lsh_layers} LSH layers")
            values = counts
        else:
            values = [counts]
        bad = [k for k in values if isinstance(k, bool) or not isinstance(k, int)
               or not 0 <= k <= self.num_attention_heads]
        if bad:
            raise ValueError(f"lsh_successor_heads must be integers from 0 to num_attention_heads "
                             f"({self.num_attention_heads}), got {counts!r}")

    def successor_heads(self, layer_index: int) -> int:
        """How many heads of layer `layer_index` (counted over all attention layers) are successor-value heads:
        heads 0..k-1, in which key s contributes the value of position s+1 and query t attends keys s < t
        only. 0 for local layers."""
        if not 0 <= layer_index < len(self.attn_layers):
            raise IndexError(f"layer_index {layer_index} is out of range for {len(self.attn_layers)} layers")
        if self.attn_layers[layer_index] != "lsh":
            return 0
        counts = self.lsh_successor_heads
        if isinstance(counts, int):
            return counts
        return counts[self.attn_layers[:layer_index].count("lsh")]

    def refuse_key_conv(self, what: str) -> None:
        """Raise for a model with n-gram keys (`lsh_key_conv_width`), which only the PyTorch forward computes."""
        if self.lsh_key_conv_width:
            raise ValueError(f"lsh_key_conv_width={self.lsh_key_conv_width}: {what} does not support n-gram keys "
                             "(an experiment the PyTorch forward and training compute)")

    def has_successor_heads(self) -> bool:
        return any(self.successor_heads(i) for i in range(len(self.attn_layers)))

    @property
    def num_hidden_layers(self) -> int:
        return len(self.attn_layers)

    @property
    def all_head_size(self) -> int:
        return self.num_attention_heads * self.attention_head_size

    def chunk_lengths(self) -> list[int]:
        kinds = set(self.attn_layers)
        out = []
        if "lsh" in kinds:
            out.append(self.lsh_attn_chunk_length)
        if "local" in kinds:
            out.append(self.local_attn_chunk_length)
        return out

    def padded_length(self, length: int) -> int:
        """The length the reference pads an unbatched sequence to in eval: a multiple of the least common
        multiple of the chunk lengths, unless the sequence fits in the smallest chunk."""
        lengths = self.chunk_lengths()
        lcm = math.lcm(*lengths)
        if length % lcm == 0 or length <= min(lengths):
            return length
        return length + lcm - length % lcm

    # ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["axial_pos_shape"] = list(self.axial_pos_shape)
        d["axial_pos_embds_dim"] = list(self.axial_pos_embds_dim)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReformerConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ReformerConfig fields: {unknown}")
        return cls(**d)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> ReformerConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_hf(cls, hf_config: Any) -> ReformerConfig:
        """From a `transformers.ReformerConfig` (or its dict). `hash_seed=None` in the reference means a
        fresh random rotation per call; serving needs determinism, so it becomes seed 0."""
        src = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        kwargs = {k: src[k] for k in _HF_FIELDS if k in src}
        if kwargs.get("hash_seed") is None:
            kwargs["hash_seed"] = 0
        if kwargs.get("eos_token_id") is None:
            kwargs["eos_token_id"] = -1
        if kwargs.get("pad_token_id") is None:
            kwargs["pad_token_id"] = 0
        for k in ("hidden_dropout_prob", "lsh_attention_probs_dropout_prob", "local_attention_probs_dropout_prob"):
            kwargs[k] = float(kwargs.get(k) or 0.0)
        kwargs["chunk_size_feed_forward"] = int(kwargs.get("chunk_size_feed_forward") or 0)
        kwargs["chunk_size_lm_head"] = int(kwargs.get("chunk_size_lm_head") or 0)
        return cls(**kwargs)

    def to_hf(self) -> Any:
        """A `transformers.ReformerConfig` (transformers is a test/import-time dependency only). Refused for
        a model with successor-value heads: transformers has no such heads, so the conversion would change
        the model's function."""
        if self.has_successor_heads():
            raise ValueError(f"lsh_successor_heads={self.lsh_successor_heads!r}: transformers' Reformer has no "
                             "successor-value heads, so this model has no transformers equivalent")
        self.refuse_key_conv("transformers' Reformer")
        from transformers import ReformerConfig as HFReformerConfig

        d = self.to_dict()
        return HFReformerConfig(**{k: d[k] for k in _HF_FIELDS}, use_cache=False)


_ACTIVATIONS = {"relu", "gelu", "gelu_new", "silu", "swish", "tanh", "gelu_fast"}
