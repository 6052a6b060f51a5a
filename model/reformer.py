"""ReformerLM: embeddings, reversible LSH/local layers, final layer norm, LM head; embeddings by pooling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import LocalSelfAttention, LSHSelfAttention
from .batch import prepare_batch
from .config import ReformerConfig
from .embeddings import AxialPositionEmbeddings, ReformerEmbeddings
from .pooling import pool_hidden
from .reversible import ReformerLayer, run_layers


@dataclass
class ReformerOutput:
    logits: Tensor  # (B, L, vocab)
    hidden_states: Tensor  # (B, L, 2*hidden), after the final layer norm


class ReformerLM(nn.Module):
    def __init__(self, config: ReformerConfig, *, fused_attention: bool = True) -> None:
        """`fused_attention`: eval forwards on CPU may use PyTorch's fused attention kernel (as nanoGPT's
        `self.flash`); False keeps the plain formulation everywhere. Results agree within float rounding."""
        super().__init__()
        self.config = config
        self.embeddings = ReformerEmbeddings(config)
        self.layers = nn.ModuleList([ReformerLayer(kind, config, i) for i, kind in enumerate(config.attn_layers)])
        for module in self.modules():
            if isinstance(module, (LSHSelfAttention, LocalSelfAttention)):
                module.fused = fused_attention
        self.final_layer_norm = nn.LayerNorm(2 * config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(2 * config.hidden_size, config.vocab_size)
        # training uses the memory-saving reversible backward; tests compare it with plain autograd
        self.reversible = True
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, AxialPositionEmbeddings):
            for w in module.weights:
                nn.init.normal_(w, std=self.config.axial_norm_std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ----------------------------------------------------------------------------------------------
    def hidden(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_offset: int = 0) -> Tensor:
        """Final hidden states (B, L, 2*hidden) in the caller's layout. The mask may pad each row on the left,
        the right or both (model/batch.py); every real token gets the result of its row alone, positions
        counted from the row's first real token. `position_offset` shifts the position embeddings
        (training uses random offsets so every axial row is trained)."""
        batch = prepare_batch(input_ids, attention_mask, self.config)
        x = self.embeddings(batch.input_ids, start=position_offset)  # (B, L', hidden)
        seeds = self._layer_seeds() if self.training else None
        y1, y2 = run_layers(self.layers, x, x, batch.context, seeds, self.reversible)
        h = self.final_layer_norm(torch.cat([y1, y2], dim=-1))  # (B, L', 2*hidden)
        h = F.dropout(h, self.config.hidden_dropout_prob, self.training)
        return batch.restore(h)  # (B, L, 2*hidden) in the caller's layout

    def _layer_seeds(self) -> list[tuple[int, int]] | None:
        cfg = self.config
        if max(cfg.hidden_dropout_prob, cfg.lsh_attention_probs_dropout_prob,
               cfg.local_attention_probs_dropout_prob) <= 0.0:
            return [(0, 0)] * len(self.layers)
        # drawn from the global generator, so a seeded training run is reproducible
        draws = torch.randint(0, 2**62, (len(self.layers), 2)).tolist()
        return [(int(a), int(b)) for a, b in draws]

    def head(self, hidden: Tensor) -> Tensor:
        chunk = self.config.chunk_size_lm_head
        if chunk <= 0 or hidden.shape[1] <= chunk:
            return self.lm_head(hidden)
        return torch.cat([self.lm_head(part) for part in hidden.split(chunk, dim=1)], dim=1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_offset: int = 0) -> ReformerOutput:
        h = self.hidden(input_ids, attention_mask, position_offset)
        return ReformerOutput(logits=self.head(h), hidden_states=h)

    @torch.no_grad()
    def embed(self, input_ids: Tensor, attention_mask: Tensor | None = None, pooling: str = "mean",
              normalize: bool = False) -> Tensor:
        """Pooled final hidden states (B, 2*hidden): mean over real tokens, or the last real token."""
        h = self.hidden(input_ids, attention_mask)
        return pool_hidden(h, attention_mask, pooling, normalize)

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_model: Any) -> ReformerLM:
        """From a `transformers` ReformerModelWithLMHead: same weights, same function."""
        from .hf import hf_state_dict_to_ours

        lm = cls(ReformerConfig.from_hf(hf_model.config))
        lm.load_state_dict(hf_state_dict_to_ours(hf_model.state_dict()))
        return lm.eval()
