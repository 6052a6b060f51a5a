"""Validation bits per byte of a model on every held-out tail of one or more folders, per file and per
folder: the figure `reformer train` reports at its end, split so that the books a model was first trained on
and the books it was later given can be read apart.

    python bench/val_bpb.py MODEL [--data corpus/data corpus/corpus | --test-books DIR] [--window 4096]
                            [--threads 2] [--out bench/results/val_bpb.json]

MODEL is an artifact directory or a training checkpoint. Each file's tail (the last `--val-fraction`, cut
exactly as the trainer cuts it: train/evaluation.py validation_tails) is scored in consecutive windows of
`--window` bytes, each window's first byte unscored (it has no context), as the trainer's final validation
does; a folder's figure is its files' bits summed over their scored bytes. With `--test-books DIR` the one
folder is the test set (bench/unseen_books.py) and every byte of each whole book is held out, so each book
is scored whole, in the same windows."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.unseen_books import add_test_books_arg, describe, held_out_documents  # noqa: E402
from train.corpus import NAMED_SETS  # noqa: E402
from train.evaluation import load_lm  # noqa: E402


@torch.no_grad()
def tail_bits(lm: torch.nn.Module, ids: np.ndarray, window: int) -> tuple[float, int]:
    """(bits, scored bytes) of `ids` in consecutive windows of `window` tokens, each predicting all but its
    first token."""
    bits, scored = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.from_numpy(ids[start:start + window]).unsqueeze(0)  # (1, W)
        if chunk.shape[1] < 2:
            break
        logits = lm(chunk[:, :-1]).logits  # (1, W-1, vocab)
        nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                              reduction="sum")
        bits += float(nll) / math.log(2)
        scored += chunk.shape[1] - 1
    return bits, scored


def measure(model: Path, folders: list[Path], window: int, val_fraction: float,
            test_books: Path | None = None) -> dict[str, Any]:
    """Per folder of `folders` (validation tails), or for the test set alone when `test_books` is given."""
    lm, tok = load_lm(model)
    began = time.perf_counter()
    groups: list[dict[str, Any]] = []
    for folder in [test_books] if test_books is not None else folders:
        files: list[dict[str, Any]] = []
        for name, ids in held_out_documents([folder], val_fraction, tok, test_books):
            bits, scored = tail_bits(lm, ids, window)
            files.append({"file": name, "bytes": scored, "bits_per_byte": round(bits / scored, 4)})
        total_bits = sum(f["bits_per_byte"] * f["bytes"] for f in files)
        total = sum(f["bytes"] for f in files)
        groups.append({"folder": "test set" if test_books is not None else str(folder), "files": files,
                       "bytes": total, "bits_per_byte": round(total_bits / total, 4) if total else None})
    what: dict[str, Any] = ({"documents": "test set", "test_books": describe(test_books)} if test_books is not None
                            else {"documents": "validation tails", "val_fraction": val_fraction})
    return {"benchmark": "val_bpb", "model": str(model), "window": window, **what,
            "groups": groups, "seconds": round(time.perf_counter() - began, 1),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def table(result: dict[str, Any]) -> str:
    lines = ["| folder | files | scored bytes | bits per byte |", "|---|---:|---:|---:|"]
    for g in result["groups"]:
        lines.append(f"| {Path(g['folder']).name} | {len(g['files'])} | {g['bytes']:,} | {g['bits_per_byte']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="artifact directory or training checkpoint")
    p.add_argument("--data", type=Path, nargs="+",
                   help="folders of books (default: the two sets `reformer data` writes, train/corpus.py)")
    add_test_books_arg(p)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "val_bpb.json")
    args = p.parse_args(argv)
    if args.test_books is not None and args.data is not None:
        p.error("--test-books scores the test set's whole books in place of --data's validation tails: give one")
    folders = args.data or [NAMED_SETS["data"], NAMED_SETS["corpus"]]
    torch.set_num_threads(args.threads)
    result = measure(args.model, folders, args.window, args.val_fraction, args.test_books)
    result["table"] = table(result)
    print(result["table"])
    print(f"\n{result['seconds']} s, load {result['loadavg_1m']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
