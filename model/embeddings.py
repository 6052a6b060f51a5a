"""Token and position embeddings: axial (two factor tables, concatenated) or a plain table."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .config import ReformerConfig


class AxialPositionEmbeddings(nn.Module):
    """Position p is [weights[0][p // S1], weights[1][p % S1]] for axial shape (S0, S1)."""

    def __init__(self, config: ReformerConfig) -> None:
        super().__init__()
        s0, s1 = config.axial_pos_shape
        d0, d1 = config.axial_pos_embds_dim
        self.shape = (s0, s1)
        self.weights = nn.ParameterList([
            nn.Parameter(torch.zeros(s0, 1, d0)),  # (S0, 1, d0)
            nn.Parameter(torch.zeros(1, s1, d1)),  # (1, S1, d1)
        ])

    def forward(self, positions: Tensor) -> Tensor:
        s1 = self.shape[1]
        first = self.weights[0][:, 0, :][positions // s1]  # (..., d0)
        second = self.weights[1][0][positions % s1]  # (..., d1)
        return torch.cat([first, second], dim=-1)  # (..., hidden)


class PositionEmbeddings(nn.Module):
    def __init__(self, config: ReformerConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, positions: Tensor) -> Tensor:
        return self.embedding(positions)


class ReformerEmbeddings(nn.Module):
    def __init__(self, config: ReformerConfig) -> None:
        super().__init__()
        self.max_positions = config.max_position_embeddings
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings: nn.Module = (
            AxialPositionEmbeddings(config) if config.axial_pos_embds else PositionEmbeddings(config)
        )
        self.dropout = config.hidden_dropout_prob

    def forward(self, input_ids: Tensor, start: int = 0) -> Tensor:
        t = input_ids.shape[-1]
        if start + t > self.max_positions:
            raise ValueError(
                f"sequence of {start + t} positions exceeds max_position_embeddings {self.max_positions}"
            )
        x = self.word_embeddings(input_ids)  # (B, L, hidden)
        x = nn.functional.dropout(x, self.dropout, self.training)
        positions = torch.arange(start, start + t, device=input_ids.device)
        return x + self.position_embeddings(positions)  # broadcast over the batch
