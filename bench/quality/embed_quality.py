"""Embedding quality: nearest-neighbour book identification of validation passages (leave-one-out: each
passage's nearest other passage by cosine similarity must come from the same book), for every pooling the
model offers (mean / last token of the final hidden states, and the mean of each layer's output),
against a bag-of-bytes baseline (each passage's normalised byte histogram) measured in the same run.
Every pooling is also measured standardised per dimension ((v - mean) / std, the mean and std of that
pooling over `--stats-passages` passages of the files' TRAINING heads, picked as `reformer export` picks
them: export/embedding_stats.py); the final mean also whitened ((v - mean) @ W, W the shrinkage-whitening
matrix of the same passages, its shrinkage chosen as `reformer export` chooses it, on those training
passages alone (export/embedding_stats.py select_shrinkage), unless `--shrinkage` gives one); and, when MODEL
is an artifact that ships
embedding_stats.safetensors, "served (artifact stats)": the final mean transformed with the artifact's
statistics as the service does (whitened when the file holds the matrix, else standardised per dimension).

    python bench/quality/embed_quality.py MODEL [--data corpus/data] [--test-books DIR] [--passage 2048]
                                  [--per-book 40] [--stats-passages 3000] [--shrinkage S] [--threads 2]
                                  [--out FILE.json]

MODEL is an artifact directory or a training checkpoint. Passages are cut, without overlap, from the
held-out tail of every file, at most `--per-book` per book so that no book dominates the accuracy. With
`--test-books DIR` they are cut from the start of each whole book of the test set instead (bench/unseen_books.py),
and identify one of its books; the standardised and whitened rows still estimate their statistics on the
training heads of `--data`, so no test-set byte shapes them."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.unseen_books import add_test_books_arg, describe, held_out_documents  # noqa: E402
from export.embedding_stats import (  # noqa: E402
    DEFAULT_PASSAGES,
    STATS_FILE,
    nn_accuracy,
    select_shrinkage,
    training_passages,
)
from model import ReformerLM  # noqa: E402
from model.pooling import EmbeddingStats, pool_hidden, standardize, standardize_pooled  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402
from train.evaluation import add_passage_args, load_lm, passages  # noqa: E402


def bag_of_bytes(ids: np.ndarray, vocab: int) -> Tensor:
    return torch.from_numpy(np.bincount(ids, minlength=vocab).astype(np.float32))


@torch.no_grad()
def poolings(lm: ReformerLM, ids: np.ndarray) -> dict[str, Tensor]:
    """Every pooling of one passage: final hidden states (mean, last) and each layer's output (mean)."""
    captured: list[Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: captured.append(torch.cat(out[:2], dim=-1)))
             for layer in lm.layers]
    try:
        h = lm.hidden(torch.from_numpy(ids).unsqueeze(0))  # (1, L, 2*hidden)
    finally:
        for hook in hooks:
            hook.remove()
    out = {"final-mean": pool_hidden(h, None, "mean", False)[0], "final-last": pool_hidden(h, None, "last", False)[0]}
    for i, layer_out in enumerate(captured):
        out[f"layer{i}-mean"] = layer_out[0, : ids.shape[0]].mean(dim=0)
    return out


def load(model_path: Path) -> tuple[ReformerLM, Tokenizer, EmbeddingStats | None]:
    """The model, its tokenizer and, for an artifact that ships them, its embedding statistics (checked)."""
    if (model_path / STATS_FILE).exists() and (model_path / "manifest.json").exists():
        from export import load_artifact

        art = load_artifact(model_path)
        return art.model.eval(), art.tokenizer, art.embedding_stats
    lm, tok = load_lm(model_path)
    return lm, tok, None


def pooled(lm: ReformerLM, cut: list[tuple[str, np.ndarray]]) -> dict[str, Tensor]:
    """Every pooling of every passage: name -> (N, D)."""
    per_pool: dict[str, list[Tensor]] = {}
    for _, ids in cut:
        for name, vec in poolings(lm, ids).items():
            per_pool.setdefault(name, []).append(vec)
    return {name: torch.stack(vecs) for name, vecs in per_pool.items()}


def measure(model_path: Path, data: list[str], passage: int, per_book: int, val_fraction: float,
            stats_passages: int = DEFAULT_PASSAGES, shrinkage: float | None = None,
            test_books: Path | None = None) -> dict[str, Any]:
    lm, tok, served_stats = load(model_path)
    cut = passages(held_out_documents(data, val_fraction, tok, test_books), passage, per_book)
    labels = [name for name, _ in cut]
    if len(set(labels)) < 2:
        raise SystemExit("embed_quality: need passages from at least two books; use a shorter --passage")
    t0 = time.perf_counter()
    per_pool = pooled(lm, cut)
    train_cut = training_passages(data, tok, val_fraction, passage, stats_passages)
    train_pool = pooled(lm, train_cut) if len(train_cut) >= 2 else {}
    rows: list[dict[str, Any]] = [{"pooling": "bag-of-bytes (baseline)",
             "accuracy": round(nn_accuracy(torch.stack([bag_of_bytes(ids, lm.config.vocab_size) for _, ids in cut]),
                                           labels), 4)}]
    for name, vecs in per_pool.items():
        rows.append({"pooling": name, "accuracy": round(nn_accuracy(vecs, labels), 4)})
    for name, vecs in per_pool.items():
        if name in train_pool:
            z = standardize(vecs, EmbeddingStats.from_vectors(train_pool[name]))
            rows.append({"pooling": f"{name} standardised", "accuracy": round(nn_accuracy(z, labels), 4)})
    selection: dict[str, Any] = {"rule": f"given ({shrinkage:g})"} if shrinkage is not None else {}
    if "final-mean" in train_pool:  # what `reformer export` now ships for the served pooling
        if shrinkage is None:
            choice = select_shrinkage(train_pool["final-mean"], [name for name, _ in train_cut])
            shrinkage, selection = choice.shrinkage, choice.record
        w = standardize(per_pool["final-mean"], EmbeddingStats.from_vectors(train_pool["final-mean"], shrinkage))
        rows.append({"pooling": "final-mean whitened", "accuracy": round(nn_accuracy(w, labels), 4)})
    if served_stats is not None:  # what the service returns for pooling "mean" (before L2, which cosine ignores)
        served = standardize_pooled(per_pool["final-mean"], "mean", served_stats)
        rows.append({"pooling": "served (artifact stats)", "accuracy": round(nn_accuracy(served, labels), 4)})
    base = rows[0]["accuracy"]
    for r in rows:
        r["vs_baseline_points"] = round(100 * (r["accuracy"] - base), 1)
    best = max(rows[1:], key=lambda r: r["accuracy"])
    books = {b: labels.count(b) for b in dict.fromkeys(labels)}
    stats_books = [name for name, _ in train_cut]
    return {"benchmark": "embed_quality", "model": str(model_path),
            "documents": "test set" if test_books is not None else "validation tails",
            "test_books": describe(test_books) if test_books is not None else None,
            "passage_bytes": passage, "passages": len(cut),
            "per_book": books, "stats_passages": len(train_cut), "whitening_shrinkage": shrinkage,
            "shrinkage_selection": selection,
            "served_method": served_stats.method if served_stats is not None else None,
            "stats_per_book": {b: stats_books.count(b) for b in dict.fromkeys(stats_books)},
            "artifact_stats": served_stats is not None, "chance": round(max(books.values()) / len(cut), 4),
            "rows": rows,
            "best_pooling": best["pooling"], "seconds": round(time.perf_counter() - t0, 1),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def table(result: dict[str, Any]) -> str:
    lines = ["| pooling | nearest-neighbour accuracy | vs bag-of-bytes (points) |", "|---|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['pooling']} | {r['accuracy']:.3f} | {r['vs_baseline_points']:+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_passage_args(p, passage=2048, out=ROOT / "bench" / "results" / "embed_quality.json")
    add_test_books_arg(p)
    p.add_argument("--per-book", type=int, default=40)
    p.add_argument("--stats-passages", type=int, default=DEFAULT_PASSAGES,
                   help="training-head passages the standardised and whitened rows estimate their statistics on")
    p.add_argument("--shrinkage", type=float,
                   help="covariance shrinkage of the whitened row (default: chosen on the training passages as "
                        "`reformer export` chooses it)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args.model, args.data, args.passage, args.per_book, args.val_fraction, args.stats_passages,
                     args.shrinkage, args.test_books)
    result["table"] = table(result)
    print(f"{result['passages']} passages of {result['passage_bytes']} bytes {result['per_book']}; "
          f"majority-book chance {result['chance']:.3f}\n")
    print(result["table"])
    print(f"\nbest pooling: {result['best_pooling']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['seconds']} s, load {result['loadavg_1m']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
