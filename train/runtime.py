"""Pieces of `reformer train` that are not the loop itself: the distributed setup, the learning-rate
schedule, time-budget parsing, validation in bits per byte, and the stop flag set by Ctrl-C."""

from __future__ import annotations

import math
import os
import re
import signal
from dataclasses import dataclass
from types import FrameType

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.reformer import ReformerLM


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ddp_backend(device_kind: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_kind == "cuda" else "gloo"


def init_distributed(device_kind: str) -> DistInfo:
    """Join the process group when started by torchrun (WORLD_SIZE > 1): gloo on CPU, NCCL on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    dist.init_process_group(backend=ddp_backend(device_kind))
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(),
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def all_reduce_sum(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.tolist()]


def average_gradients(lm: torch.nn.Module, info: DistInfo) -> None:
    """Explicit gradient all-reduce (mean over ranks), for the `--ddp allreduce` mode."""
    grads = [p.grad for p in lm.parameters() if p.grad is not None]
    if not info.enabled or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= info.world_size
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def parse_duration(text: str) -> float:
    """'90' or '90s' -> 90 s; '80m' -> 4800 s; '1.5h' -> 5400 s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smh]?)\s*", text)
    if m is None:
        raise ValueError(f"cannot read duration {text!r}: use e.g. 600, 600s, 80m or 1.5h")
    scale = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2)]
    return float(m.group(1)) * scale


def lr_factor(progress: float, step: int, warmup_steps: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay from 1 to `min_ratio` as progress goes 0 -> 1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate_bpb(lm: ReformerLM, windows: list[np.ndarray], device: torch.device, info: DistInfo,
                 autocast_dtype: torch.dtype | None = None) -> tuple[float, int]:
    """Validation bits per byte (= bits per token for a byte tokenizer) over fixed windows: each window
    predicts its tokens 1..n from 0..n-1 at positions 0..; the windows are shared out over ranks and the
    sums combined. Returns (bpb, number of predicted bytes)."""
    was_training = lm.training
    lm.eval()
    nll, count = 0.0, 0
    for w in windows[info.rank::info.world_size]:
        ids = torch.from_numpy(w).to(device).unsqueeze(0)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = lm(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                               reduction="sum")
        nll += float(loss)
        count += ids.shape[1] - 1
    nll, total = all_reduce_sum([nll, float(count)], info, device)
    lm.train(was_training)
    return (nll / max(total, 1.0) / math.log(2), int(total))


class StopFlag:
    """Set by SIGINT/SIGTERM; the loop finishes its step, saves a checkpoint and exits. A second Ctrl-C
    falls through to Python's default (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name


def max_weight_divergence(lm: torch.nn.Module, info: DistInfo) -> float:
    """Largest absolute difference between this rank's weights and rank 0's, over all ranks: 0.0 when
    gradient sync kept every replica identical (checked at the end of every multi-process run)."""
    if not info.enabled:
        return 0.0
    flat = torch.cat([p.detach().reshape(-1).float() for p in lm.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)
