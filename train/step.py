"""One training step's forward and loss, shared by `reformer train` and bench/training/train_speed.py so that the
benchmark times exactly what the trainer runs; and the choices that make it fast on a given machine:
reversible or plain autograd, autocast dtype, `torch.compile`."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from model.reformer import ReformerLM

LossFn = Callable[[Tensor, int], Tensor]


def autocast_dtype(device: torch.device, bf16: bool) -> torch.dtype | None:
    """bf16 autocast on CUDA when asked; None (fp32) otherwise: CPU bf16 matmuls are slower than fp32
    on machines without AMX, and the trainer's figures are fp32."""
    return torch.bfloat16 if bf16 and device.type == "cuda" else None


def activation_bytes(lm: ReformerLM, batch: int, window: int) -> int:
    """A generous estimate of what plain (non-reversible) autograd keeps for one micro-batch: per layer
    the hidden states and feed-forward activations of every token, plus the attention score blocks
    (queries x (chunks before + 1) x chunk keys, per head and hash round), all fp32."""
    cfg = lm.config
    tokens = batch * window
    per_layer = 12 * cfg.hidden_size + 3 * cfg.feed_forward_size
    heads = cfg.num_attention_heads
    span = (1 + max(cfg.lsh_num_chunks_before, cfg.local_num_chunks_before)) * max(cfg.chunk_lengths())
    scores = 3 * heads * max(cfg.num_hashes, 1) * min(span, window)
    return 4 * tokens * cfg.num_hidden_layers * (per_layer + scores) + 4 * tokens * cfg.vocab_size * 3


def available_memory_bytes() -> int:
    """MemAvailable (free memory plus the page cache the kernel can drop) where Linux reports it: free pages
    alone look small on a machine that has read its training data, and would pick the slower reversible
    backward for no reason."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def choose_reversible(setting: str, lm: ReformerLM, batch: int, window: int, device: torch.device) -> bool:
    """'on' / 'off', or 'auto': plain autograd (no recomputation in the backward, about a third less work)
    when its activations take at most a quarter of the free memory, the reversible backward otherwise."""
    if setting in ("on", "off"):
        return setting == "on"
    need = activation_bytes(lm, batch, window)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = available_memory_bytes()
    return not (free > 0 and need <= free // 4)


def make_loss_fn(model: torch.nn.Module, dtype: torch.dtype | None, device_type: str, compile: bool = False
                 ) -> LossFn:
    """(ids (B, T+1), position offset) -> mean next-token cross entropy (nats). With `compile`, the forward
    and loss go through `torch.compile` (dynamic=False: one graph per window length)."""

    def loss_fn(ids: Tensor, offset: int) -> Tensor:
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            logits = model(ids[:, :-1], position_offset=offset).logits  # (B, T, vocab)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    if compile:
        # a graph that fails to compile runs eagerly instead of ending a long training run
        import torch._dynamo as dynamo

        dynamo.config.suppress_errors = True
        return torch.compile(loss_fn, dynamic=False)  # type: ignore[return-value]
    return loss_fn
