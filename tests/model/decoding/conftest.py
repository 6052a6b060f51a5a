"""Fixtures of the extend tests (test_extend.py, test_extend_all_logits.py): the shipped model and a tiny one."""

from __future__ import annotations

import pytest
import torch

from export.artifact import load_artifact
from model import ReformerLM

from ..helpers import tiny_config
from .extend_oracle import VOCAB


@pytest.fixture(scope="module")
def shipped() -> ReformerLM:
    return load_artifact(check_hashes=False).model


@pytest.fixture(scope="module")
def tiny() -> ReformerLM:
    """Chunks of 8 (prompts cross chunks within a few tokens), a successor-value head, 2 hash rounds."""
    torch.manual_seed(0)
    return ReformerLM(tiny_config(vocab_size=VOCAB, lsh_successor_heads=1)).eval()
