"""Decode quality: how far the cached decoding path is from full recomputation on a real model.

For a model with several LSH layers, the cache keeps earlier positions' hidden states as they were
computed, while a full forward recomputes them with the new token in the sort. This measures the effect on
held-out text (the tails the training split holds out):

- teacher-forced bits per byte of the continuation, cached path vs one full forward (target: within 2%);
- greedy top-1 agreement: at every step of a greedy continuation through the cache, does the full forward
  on the same prefix pick the same token (target: at least 98%).

    python bench/decode/decode_quality.py [--artifact DIR] [--data DIR] [--prompt-len 1024] [--eval-len 256]
                                   [--samples 3] [--continuation 256] [--kv-cache-dtype float16]

`--kv-cache-dtype bfloat16|float16` keeps the cache's keys and values in that dtype (REFORMER_KV_CACHE_DTYPE):
the cached path then also carries their rounding, and the same two measures say what it costs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from model.decoding import DecodeCache, Decoder, prefill
from train.corpus_manifest import set_folder

RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results


def held_out_windows(data: Path, tokenizer, length: int, samples: int) -> list[list[int]]:  # noqa: ANN001
    from train.data import find_text_files, read_document, split_point

    windows = []
    for f in find_text_files([data]):
        ids = tokenizer.encode(read_document(f))
        tail = ids[split_point(len(ids), 0.05):]
        if len(tail) >= length:
            windows.append(tail[:length])
    if not windows:
        raise SystemExit(f"no held-out tail of {length} tokens in {data}")
    return (windows * samples)[:samples]


@torch.no_grad()
def teacher_forced(lm, window: list[int], prompt_len: int, kv_dtype: torch.dtype | None = None  # noqa: ANN001
                   ) -> tuple[float, float]:
    """Bits per byte of window[prompt_len:] given everything before it: (full forward, cached path)."""
    ids = torch.tensor(window)
    targets = ids[prompt_len:]
    full = lm(ids[None, :-1]).logits[0, prompt_len - 1:]  # predicts window[prompt_len:]
    cache = DecodeCache.for_tokens(lm, len(window), kv_dtype=kv_dtype)
    decoder = Decoder(lm, cache)
    first, states = prefill(lm, cache, [ids[:prompt_len]], [len(window)])
    cached = [first[0]]
    for tok in ids[prompt_len:-1].tolist():
        cached.append(decoder.step(torch.tensor([tok]), states)[0])
    ce_full = torch.nn.functional.cross_entropy(full, targets).item()
    ce_cached = torch.nn.functional.cross_entropy(torch.stack(cached), targets).item()
    return ce_full / math.log(2), ce_cached / math.log(2)


@torch.no_grad()
def greedy_agreement(lm, prompt: list[int], steps: int, kv_dtype: torch.dtype | None = None  # noqa: ANN001
                     ) -> tuple[int, int]:
    cache = DecodeCache.for_tokens(lm, len(prompt) + steps + 1, kv_dtype=kv_dtype)
    decoder = Decoder(lm, cache)
    first, states = prefill(lm, cache, [torch.tensor(prompt)], [len(prompt) + steps + 1])
    logits = first[0]
    seq = list(prompt)
    agree = 0
    for _ in range(steps):
        cached_choice = int(logits.argmax())
        full_choice = int(lm(torch.tensor([seq])).logits[0, -1].argmax())
        agree += cached_choice == full_choice
        seq.append(cached_choice)
        logits = decoder.step(torch.tensor([cached_choice]), states)[0]
    return agree, steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", default=None, help="artifact directory (default: the shipped model)")
    p.add_argument("--data", type=Path, default=set_folder("data"),
                   help="folder of books (default: corpus/data, written by `reformer data`)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--eval-len", type=int, default=256)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", type=Path, default=RESULTS / "decode_quality.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from export import load_artifact

    art = load_artifact(args.artifact) if args.artifact else load_artifact()
    lm = art.model
    windows = held_out_windows(args.data, art.tokenizer, args.prompt_len + args.eval_len, args.samples)
    kv_dtype = getattr(torch, args.kv_cache_dtype)
    rows = []
    start = time.perf_counter()
    for i, w in enumerate(windows):
        bpb_full, bpb_cached = teacher_forced(lm, w, args.prompt_len, kv_dtype)
        agree, total = greedy_agreement(lm, w[: args.prompt_len], args.continuation, kv_dtype)
        rows.append({"sample": i, "bpb_full": bpb_full, "bpb_cached": bpb_cached,
                     "bpb_relative_change": bpb_cached / bpb_full - 1, "greedy_agree": agree, "greedy_total": total})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    summary = {
        "artifact": str(art.path), "layers": art.config.attn_layers, "num_hashes": art.config.num_hashes,
        "prompt_len": args.prompt_len, "eval_len": args.eval_len, "continuation": args.continuation,
        "kv_cache_dtype": args.kv_cache_dtype,
        "bpb_full": sum(r["bpb_full"] for r in rows) / len(rows),
        "bpb_cached": sum(r["bpb_cached"] for r in rows) / len(rows),
        "greedy_agreement": sum(r["greedy_agree"] for r in rows) / sum(r["greedy_total"] for r in rows),
        "seconds": time.perf_counter() - start, "rows": rows,
    }
    summary["bpb_relative_change"] = summary["bpb_cached"] / summary["bpb_full"] - 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"cached vs full decoding ({args.samples} held-out samples, prompt {args.prompt_len}, "
                        f"cache in {args.kv_cache_dtype})")
    for col in ("measure", "full forward", "cached path", "difference", "target"):
        table.add_column(col)
    table.add_row("teacher-forced bits/byte", f"{summary['bpb_full']:.4f}", f"{summary['bpb_cached']:.4f}",
                  f"{100 * summary['bpb_relative_change']:+.2f}%", "within 2%")
    table.add_row("greedy top-1 agreement", "", "", f"{100 * summary['greedy_agreement']:.1f}%", ">= 98%")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
