"""What the after-training measurements share (bench/long_context.py, bench/quality/embed_quality.py): loading a
trained model from an artifact or a checkpoint, and the held-out validation tails of the training files,
cut exactly as `reformer train` cut them."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from model import ByteTokenizer, ReformerLM
from model.tokenizer import Tokenizer

from .corpus_manifest import set_folder
from .data import find_text_files, read_document, split_point


def load_lm(path: str | Path) -> tuple[ReformerLM, Tokenizer]:
    """An artifact directory (config.json + model.safetensors + tokenizer.json) or a training checkpoint
    (model.safetensors with the config in its metadata), in eval mode."""
    p = Path(path)
    if (p / "manifest.json").exists():
        from export import load_artifact

        art = load_artifact(p)
        return art.model.eval(), art.tokenizer
    from export.checkpoint import load_checkpoint_model

    return load_checkpoint_model(p), ByteTokenizer()


def validation_tails(sources: Sequence[str | Path], val_fraction: float, tokenizer: Tokenizer
                     ) -> list[tuple[str, np.ndarray]]:
    """(file name, token ids) of each document's held-out tail: the bytes the trainer never trained on."""
    out = []
    for f in find_text_files(sources):
        ids = np.asarray(tokenizer.encode(read_document(f)), dtype=np.int64)
        out.append((f.name, ids[split_point(len(ids), val_fraction):]))
    return out


def passages(tails: list[tuple[str, np.ndarray]], length: int, per_book: int | None = None
             ) -> list[tuple[str, np.ndarray]]:
    """Non-overlapping passages of `length` tokens from the start of every tail (at most `per_book` each)."""
    out: list[tuple[str, np.ndarray]] = []
    for name, ids in tails:
        n = len(ids) // length
        if per_book is not None:
            n = min(n, per_book)
        out.extend((name, ids[i * length:(i + 1) * length]) for i in range(n))
    return out


@torch.no_grad()
def nll_bits_of_last(lm: ReformerLM, ids: np.ndarray, last: int, position_offset: int = 0) -> float:
    """Total bits the model spends on the last `last` tokens of `ids`, given everything before them, with
    the first token at position `position_offset`."""
    x = torch.from_numpy(ids).unsqueeze(0)  # (1, L)
    logits = lm(x[:, :-1], position_offset=position_offset).logits[:, -last:]  # (1, last, vocab)
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, -last:].reshape(-1), reduction="sum")
    return float(nll) / math.log(2)


def add_passage_args(p: argparse.ArgumentParser, passage: int, out: Path) -> None:
    """The arguments of every benchmark over validation passages: the model, the books and their held-out
    split, the passage length, threads and the JSON output."""
    p.add_argument("model", type=Path, help="artifact directory or training checkpoint")
    p.add_argument("--data", nargs="+", default=[str(set_folder("data"))],
                   help="files or folders of books (default: corpus/data, written by `reformer data`)")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--passage", type=int, default=passage)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=out)
