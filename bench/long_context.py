"""Long context measured: bits per byte of the last `--tail` bytes of `--passage`-byte validation passages,
given the whole passage before them vs given only the `--context` bytes just before them. The Reformer's
reason to exist: with distant text to look at, the long-context figure should be lower.

    python bench/long_context.py MODEL [--data ../shared/data] [--passage 16384] [--tail 1024]
                                 [--context 1024] [--max-passages 0] [--threads 2] [--out FILE.json]

MODEL is an artifact directory (export/default_artifact) or a training checkpoint (runs/NAME/checkpoint).
Passages are cut, without overlap, from the held-out tail of every file (`--val-fraction`, as in
`reformer train`), so the model never trained on a byte of them. In the short case the first target byte
sees exactly `--context` bytes before it, the last one `--context + tail - 1`.

The two cases score the same bytes at different positions (the end of the passage against the start of a
short input), so a third, the control, gives the short context at the passage's own positions (position
offset `passage - context - tail`): whole against control is the effect of distant text alone, control
against short that of the positions alone."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from train.evaluation import add_passage_args, load_lm, nll_bits_of_last, passages, validation_tails  # noqa: E402


def measure(model_path: Path, data: list[str], passage: int, tail: int, context: int, val_fraction: float,
            max_passages: int) -> dict[str, Any]:
    lm, tok = load_lm(model_path)
    cut = passages(validation_tails(data, val_fraction, tok), passage)
    if max_passages:
        cut = cut[:max_passages]
    if not cut:
        raise SystemExit(f"long_context: no validation tail holds a {passage}-byte passage; use a shorter --passage")
    per_book: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for name, ids in cut:
        full = nll_bits_of_last(lm, ids, tail)
        short = nll_bits_of_last(lm, ids[-(context + tail):], tail)
        control = nll_bits_of_last(lm, ids[-(context + tail):], tail, position_offset=len(ids) - context - tail)
        b = per_book.setdefault(name, {"passages": 0, "full_bits": 0.0, "short_bits": 0.0, "control_bits": 0.0})
        b["passages"] += 1
        b["full_bits"] += full
        b["short_bits"] += short
        b["control_bits"] += control
    rows: list[dict[str, Any]] = []
    for name, b in per_book.items():
        n = b["passages"] * tail
        rows.append({"book": name, "passages": int(b["passages"]), "bytes_scored": int(n),
                     "bpb_full_context": round(b["full_bits"] / n, 4),
                     "bpb_short_context": round(b["short_bits"] / n, 4),
                     "bpb_short_context_same_positions": round(b["control_bits"] / n, 4)})
    n_all = sum(r["bytes_scored"] for r in rows)
    total = {"book": "all", "passages": sum(r["passages"] for r in rows), "bytes_scored": n_all,
             "bpb_full_context": round(sum(b["full_bits"] for b in per_book.values()) / n_all, 4),
             "bpb_short_context": round(sum(b["short_bits"] for b in per_book.values()) / n_all, 4),
             "bpb_short_context_same_positions":
                 round(sum(b["control_bits"] for b in per_book.values()) / n_all, 4)}
    return {"benchmark": "long_context", "model": str(model_path), "passage_bytes": passage, "tail_bytes": tail,
            "short_context_bytes": context, "val_fraction": val_fraction, "rows": [*rows, total],
            "seconds": round(time.perf_counter() - t0, 1), "loadavg_1m": round(os.getloadavg()[0], 2)}


def table(result: dict[str, Any]) -> str:
    lines = [f"| book | passages | bytes scored | bpb, whole {result['passage_bytes']}-byte passage | "
             f"bpb, preceding {result['short_context_bytes']} bytes only | difference | "
             "control: those bytes at the passage's positions | whole - control |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        control = r["bpb_short_context_same_positions"]
        lines.append(f"| {r['book']} | {r['passages']} | {r['bytes_scored']:,} | {r['bpb_full_context']:.4f} | "
                     f"{r['bpb_short_context']:.4f} | {r['bpb_full_context'] - r['bpb_short_context']:+.4f} | "
                     f"{control:.4f} | {r['bpb_full_context'] - control:+.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_passage_args(p, passage=16384, out=ROOT / "bench" / "results" / "long_context.json")
    p.add_argument("--tail", type=int, default=1024)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-passages", type=int, default=0, help="0: every passage")
    args = p.parse_args(argv)
    if args.tail + args.context > args.passage:
        p.error("--tail + --context must fit in --passage")
    torch.set_num_threads(args.threads)
    result = measure(args.model, args.data, args.passage, args.tail, args.context, args.val_fraction,
                     args.max_passages)
    result["table"] = table(result)
    print(result["table"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out} ({result['seconds']} s, load {result['loadavg_1m']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
