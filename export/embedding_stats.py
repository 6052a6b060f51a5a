"""Embedding statistics shipped with an artifact (embedding_stats.safetensors): the per-dimension mean and
std of mean-pooled final hidden states over passages of the TRAINING part of each document (the head before
the held-out validation tail, cut as `reformer train` cuts it), so no validation byte shapes them. The
service standardises mean-pooled embeddings with them (model/pooling.py); bench/embed_quality.py estimates
its standardised rows with the same functions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from model import ByteTokenizer, ReformerLM
from model.pooling import EmbeddingStats, pool_hidden
from train.data import find_text_files, read_document, split_point

STATS_FILE = "embedding_stats.safetensors"
DEFAULT_PASSAGES = 60
DEFAULT_PASSAGE_BYTES = 2048


def training_passages(sources: list[str | Path], tokenizer: ByteTokenizer, val_fraction: float,
                      length: int = DEFAULT_PASSAGE_BYTES, count: int = DEFAULT_PASSAGES
                      ) -> list[tuple[str, np.ndarray]]:
    """Up to `count` passages of `length` tokens, shared evenly among the documents and spread evenly over
    each document's training head (everything before its validation tail; a head shorter than `length`
    gives one shorter passage)."""
    heads = []
    for f in find_text_files(sources):
        ids = np.asarray(tokenizer.encode(read_document(f)), dtype=np.int64)
        head = ids[:split_point(len(ids), val_fraction)]
        if len(head) >= 2:
            heads.append((f.name, head))
    out: list[tuple[str, np.ndarray]] = []
    for i, (name, head) in enumerate(heads):
        n = count // len(heads) + (1 if i < count % len(heads) else 0)  # the remainder goes to the first files
        n = min(n, max(1, len(head) // length))  # no overlap between passages
        starts = np.linspace(0, max(0, len(head) - length), n).round().astype(np.int64)
        out.extend((name, head[int(s):int(s) + length]) for s in starts)
    return out


@torch.no_grad()
def compute_embedding_stats(lm: ReformerLM, passages: list[tuple[str, np.ndarray]]) -> EmbeddingStats:
    """Mean and std of the mean-pooled final hidden states (what the service's "mean" pooling gives)."""
    lm = lm.eval()
    device = next(lm.parameters()).device
    vecs = [pool_hidden(lm.hidden(torch.from_numpy(ids).unsqueeze(0).to(device)), None, "mean")[0].float().cpu()
            for _, ids in passages]
    return EmbeddingStats.from_vectors(torch.stack(vecs))


def stats_for_export(lm: ReformerLM, tokenizer: ByteTokenizer, sources: list[str | Path] | None, val_fraction: float,
                     length: int = DEFAULT_PASSAGE_BYTES, count: int = DEFAULT_PASSAGES
                     ) -> tuple[EmbeddingStats | None, dict[str, Any]]:
    """The statistics and the manifest's record of how they were computed, or (None, why they were not)."""
    if not sources:
        return None, {"skipped": "no training data given (--eval-data): mean-pooled embeddings are served raw"}
    if count <= 0:
        return None, {"skipped": "turned off (--embed-stats-passages 0): mean-pooled embeddings are served raw"}
    length = min(length, int(lm.config.max_position_embeddings))
    cut = training_passages(sources, tokenizer, val_fraction, length, count)
    if len(cut) < 2:
        return None, {"skipped": f"fewer than two training passages in {[str(s) for s in sources]}"}
    stats = compute_embedding_stats(lm, cut)
    files = sorted({name for name, _ in cut})
    return stats, {
        "file": STATS_FILE,
        "pooling": "mean",
        "what": "per-dimension mean and std (population, floored at 1e-6) of mean-pooled final hidden states",
        "passages": len(cut),
        "passage_bytes": length,
        "bytes": int(sum(len(ids) for _, ids in cut)),
        "per_file": {f: sum(1 for name, _ in cut if name == f) for f in files},
        "source_files": files,
        "val_fraction": val_fraction,
        "held_out": "passages are from each document's training head; none from its validation tail",
    }


def write_embedding_stats(path: Path, stats: EmbeddingStats) -> None:
    save_file({"mean": stats.mean.float().contiguous(), "std": stats.std.float().contiguous()}, str(path))


def read_embedding_stats(path: Path, dim: int) -> EmbeddingStats:
    """Read and check the file; ValueError says what is wrong (the artifact loader names the file)."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot be read as safetensors ({e})") from e
    for name in ("mean", "std"):
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"no tensor {name!r}")
        if t.dtype != torch.float32 or tuple(t.shape) != (dim,):
            raise ValueError(f"tensor {name!r} is {t.dtype} {tuple(t.shape)}, expected float32 ({dim},) "
                             "(twice the config's hidden_size)")
        if not torch.isfinite(t).all():
            raise ValueError(f"tensor {name!r} has non-finite values")
    if not (tensors["std"] > 0).all():
        raise ValueError("tensor 'std' has values <= 0")
    return EmbeddingStats(mean=tensors["mean"], std=tensors["std"])
