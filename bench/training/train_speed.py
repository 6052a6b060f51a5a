"""Training speed: tokens/s of `reformer train`'s step (forward, backward, AdamW step) against a plain causal
transformer of the same width, depth and feed-forward size (`scaled_dot_product_attention`, pre-LN,
learned positions), same batch tokens, same threads, windows 128 ... 16384, in one run.

    python bench/training/train_speed.py [--windows 128,512,4096,16384] [--batch-tokens 8192] [--steps 3]
                                [--variants reversible,plain,compiled] [--threads 2] [--out FILE.json]

Reformer variants: `reversible` (the memory-saving backward that recomputes each layer), `plain` (ordinary
autograd, what `reformer train --reversible auto` picks when memory allows), `compiled` (plain autograd with
the forward and loss under `torch.compile`; its compile time is reported separately). Each figure is
the median step time over `--steps` timed steps after one warm-up step; the ratio column is against the
transformer measured in the same run. The machine's load average is printed with every row: on a
shared machine only the ratios mean much."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from model import ReformerConfig, ReformerLM  # noqa: E402
from model.decoding.runtime import tune_cpu_runtime  # noqa: E402
from train.step import make_loss_fn  # noqa: E402


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.ff = nn.Sequential(nn.Linear(hidden, ff), nn.ReLU(), nn.Linear(ff, hidden))

    def forward(self, x: Tensor) -> Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)  # 3x(B,H,T,D)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))  # (B, T, hidden)
        return x + self.ff(self.ln2(x))


class PlainTransformer(nn.Module):
    """The anchor: a causal pre-LN transformer with full attention."""

    def __init__(self, vocab: int, hidden: int, heads: int, ff: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.blocks = nn.ModuleList([Block(hidden, heads, ff) for _ in range(layers)])
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def reformer_config(hidden: int, heads: int, ff: int, layers: str, chunk: int) -> ReformerConfig:
    return ReformerConfig(
        vocab_size=258, hidden_size=hidden, num_attention_heads=heads, attention_head_size=hidden // heads,
        attn_layers=layers.split(","), feed_forward_size=ff, lsh_attn_chunk_length=chunk,
        local_attn_chunk_length=chunk, num_hashes=2, num_buckets=64, axial_pos_shape=(16, 4096),
        axial_pos_embds_dim=(hidden // 2, hidden // 2), max_position_embeddings=65536, initializer_range=0.1,
        axial_norm_std=0.02, is_decoder=True)


def time_steps(step: Any, steps: int) -> tuple[float, float]:
    """-> (first step's seconds (warm-up, compile), median of the timed steps)."""
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def measure(variant: str, window: int, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    loss_fn: Callable[[Tensor, int], Tensor]
    ids = torch.randint(2, 258, (batch, window + 1), generator=torch.Generator().manual_seed(window))
    if variant == "transformer":
        model: nn.Module = PlainTransformer(258, args.hidden, args.heads, args.ff, len(args.layers.split(",")),
                                            window)

        def loss_of(x: Tensor, offset: int) -> Tensor:
            logits = model(x[:, :-1])  # (B, T, vocab)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss_fn = loss_of
    else:
        lm = ReformerLM(reformer_config(args.hidden, args.heads, args.ff, args.layers, args.chunk)).train()
        lm.reversible = variant == "reversible"
        model = lm
        loss_fn = make_loss_fn(lm, None, "cpu", compile=variant == "compiled")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # as train/loop.py, for both models

    def step() -> None:
        loss_fn(ids, 0).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first, median = time_steps(step, args.steps)
    return {"variant": variant, "window": window, "batch": batch, "tokens_per_step": batch * window,
            "parameters": sum(p.numel() for p in model.parameters()), "first_step_s": round(first, 3),
            "step_s": round(median, 4), "tokens_per_s": round(batch * window / median, 1),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def table(rows: list[dict[str, Any]]) -> str:
    anchor = {r["window"]: r["tokens_per_s"] for r in rows if r["variant"] == "transformer"}
    lines = ["| window | batch | variant | tokens/s | vs transformer | first step (s) | load avg |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["tokens_per_s"] / anchor[r["window"]] if r["window"] in anchor else math.nan
        lines.append(f"| {r['window']} | {r['batch']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {ratio:.2f} | "
                     f"{r['first_step_s']:.1f} | {r['loadavg_1m']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", default="128,512,4096,16384")
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per step (batch = this / window, >= 1)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--variants", default="reversible,plain,compiled")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ff", type=int, default=512)
    p.add_argument("--layers", default="local,lsh,local,lsh")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "train_speed.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_cpu_runtime()  # as `reformer train` runs, for both models
    rows: list[dict[str, Any]] = []
    for window in (int(w) for w in args.windows.split(",")):
        batch = max(1, args.batch_tokens // window)
        for variant in ["transformer", *args.variants.split(",")]:
            rows.append(measure(variant, window, batch, args))
            r = rows[-1]
            print(f"window {window:>6} x {batch:<3} {variant:<11} {r['tokens_per_s']:>9,.0f} tokens/s  "
                  f"(first step {r['first_step_s']:.1f} s, load {r['loadavg_1m']:.2f})", flush=True)
    print()
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "train_speed", "rows": rows, "table": table(rows),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__}}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
