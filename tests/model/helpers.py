"""Tiny configurations and a reference model built from the same random weights."""

from __future__ import annotations

from typing import Any

import torch

from model import ReformerConfig, ReformerLM

TINY: dict[str, Any] = dict(
    vocab_size=40, hidden_size=32, num_attention_heads=2, attention_head_size=16,
    attn_layers=["local", "lsh", "local", "lsh"], feed_forward_size=64, lsh_attn_chunk_length=8,
    local_attn_chunk_length=8, num_hashes=2, num_buckets=8, axial_pos_shape=(64, 64),
    axial_pos_embds_dim=(16, 16), max_position_embeddings=4096, hash_seed=42, is_decoder=True,
    hidden_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
    # a large init makes attention sharp, so a wrong key or mask shows up in the logits
    initializer_range=0.5, axial_norm_std=0.5, eos_token_id=1, pad_token_id=0,
)


def tiny_config(**overrides: Any) -> ReformerConfig:
    return ReformerConfig(**{**TINY, **overrides})


def reference_pair(**overrides: Any) -> tuple[Any, ReformerLM]:
    """A transformers ReformerModelWithLMHead with random weights, and our model loaded from it."""
    from transformers import ReformerConfig as HFConfig
    from transformers import ReformerForMaskedLM, ReformerModelWithLMHead

    torch.manual_seed(0)
    params = {**TINY, **overrides}
    # the causal LM class insists on is_decoder; the masked-LM class has the same weights and head
    cls = ReformerModelWithLMHead if params["is_decoder"] else ReformerForMaskedLM
    hf = cls(HFConfig(**params, use_cache=False)).eval()
    return hf, ReformerLM.from_hf(hf)


def random_ids(batch: int, length: int, vocab: int = 40, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def decode_greedily(lm: ReformerLM, lengths: list[int], steps: int, *, cpu_kernel: bool, recent: int,
                    block_size: int = 8, seed: int = 7) -> torch.Tensor:
    """The logits (steps, len(lengths), vocab) of greedy cached decoding after random prompts of `lengths`,
    through a cache with LSH recent orders of `recent` (merges every `recent` steps) and blocks of `block_size`."""
    from model.decoding import DecodeCache, Decoder, prefill

    cache = DecodeCache.for_tokens(lm, max(lengths) + steps + 1, slots=len(lengths), block_size=block_size,
                                   recent=recent, cpu_kernel=cpu_kernel)
    assert (cache.kernel is not None) == cpu_kernel
    decoder = Decoder(lm, cache)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, lm.config.vocab_size, (n,), generator=g) for n in lengths]
    out = []
    with torch.no_grad():
        first, states = prefill(lm, cache, prompts, [n + steps + 1 for n in lengths])
        token = first.argmax(-1)
        for _ in range(steps):
            logits = decoder.step(token, states)
            out.append(logits)
            token = logits.argmax(-1)
    return torch.stack(out)
