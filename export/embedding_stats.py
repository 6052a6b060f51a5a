"""Embedding statistics shipped with an artifact (embedding_stats.safetensors) and estimated on mean-pooled
final hidden states of passages of the TRAINING part of each document (the head before the held-out
validation tail, cut by export/documents.py as `reformer train` cuts it), so no validation byte shapes
them: the per-dimension mean and std, and the shrinkage-whitening matrix (model/pooling.py's
whitening_matrix). The service whitens mean-pooled embeddings with them, or, for an older file without the
matrix, standardises them per dimension (model/pooling.py); bench/quality/embed_quality.py estimates its standardised
and whitened rows with the same functions.

The shrinkage is chosen per model, on training passages only (`select_shrinkage`): the last fifth of each
document's passages (in text order) are held out, every shrinkage of SHRINKAGE_GRID whitens with the
statistics of the other passages, and the one whose held-out passages identify their document best by
nearest neighbour (as bench/quality/embed_quality.py scores the validation passages) is kept; ties go to the
larger shrinkage. The shipped statistics are then estimated on all the passages with it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from export.documents import find_text_files, read_document, split_point
from model import ReformerLM
from model.pooling import EmbeddingStats, pool_hidden, standardize
from model.tokenizer import Tokenizer

STATS_FILE = "embedding_stats.safetensors"
# up to 1,000 passages per document of the default data (all its non-overlapping 2,048-byte passages but War
# and Peace's): a covariance of 256 dimensions estimated on several times as many vectors, so the shrinkage
# has less sampling noise to make up for
DEFAULT_PASSAGES = 3000
# 1.0 keeps only the mean (W a multiple of I: cosine of centred vectors); 0 is the plain sample covariance
SHRINKAGE_GRID = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0)
SELECTION_FRACTION = 0.2  # of each document's passages, the last, held out to choose the shrinkage
FALLBACK_SHRINKAGE = 0.1  # when too few passages or documents are left to choose with


def whitening_what(shrinkage: float) -> str:
    return ("per-dimension mean and std (population, floored at 1e-6) and the whitening matrix W = V diag(e)^-1/2"
            f" of the shrunk covariance {1 - shrinkage:g} C + {shrinkage:g} mean(diag C) I = V diag(e) V^T"
            " (C unbiased) of mean-pooled final hidden states; served as (v - mean) @ W")


DEFAULT_PASSAGE_BYTES = 2048


def training_passages(sources: Sequence[str | Path], tokenizer: Tokenizer, val_fraction: float,
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


def nn_accuracy(vectors: torch.Tensor, labels: list[str]) -> float:
    """Leave-one-out 1-nearest-neighbour accuracy under cosine similarity: the share of vectors whose most
    similar other vector has the same label."""
    v = F.normalize(vectors.float(), dim=-1)
    sim = v @ v.T  # (N, N)
    sim.fill_diagonal_(-float("inf"))
    nearest = sim.argmax(dim=1).tolist()
    return sum(labels[i] == labels[j] for i, j in enumerate(nearest)) / len(labels)


def selection_split(names: list[str], fraction: float = SELECTION_FRACTION) -> list[bool]:
    """True for the passages held out to choose the shrinkage: the last `fraction` (rounded, at least one) of
    each document's passages, in the order `training_passages` gives them (text order); a document with a
    single passage keeps it for fitting."""
    held = [False] * len(names)
    for name in dict.fromkeys(names):
        at = [i for i, n in enumerate(names) if n == name]
        k = max(1, round(fraction * len(at))) if len(at) >= 2 else 0
        for i in at[len(at) - k:]:
            held[i] = True
    return held


@dataclass(frozen=True)
class ShrinkageChoice:
    shrinkage: float
    record: dict[str, Any]  # how it was chosen, for the manifest


def select_shrinkage(vectors: torch.Tensor, names: list[str], grid: tuple[float, ...] = SHRINKAGE_GRID,
                     fraction: float = SELECTION_FRACTION) -> ShrinkageChoice:
    """The shrinkage of `grid` whose whitening, estimated on the passages `selection_split` keeps for fitting,
    gives the held-out passages the best leave-one-out nearest-neighbour document accuracy (ties: the larger
    shrinkage). Falls back to FALLBACK_SHRINKAGE when fewer than two passages are left on either side or the
    held-out passages come from one document."""
    held = selection_split(names, fraction)
    fit = vectors[[not h for h in held]]
    test = vectors[held]
    labels = [n for n, h in zip(names, held) if h]
    rule = (f"the last {fraction:g} of each document's training passages held out; each shrinkage whitens with "
            "the others' statistics; best held-out nearest-neighbour document accuracy, ties to the larger")
    if fit.shape[0] < 2 or test.shape[0] < 2 or len(set(labels)) < 2:
        return ShrinkageChoice(FALLBACK_SHRINKAGE, {
            "rule": f"fallback {FALLBACK_SHRINKAGE}: {fit.shape[0]} fitting and {test.shape[0]} held-out passages "
                    f"from {len(set(labels))} documents are too few to choose with"})
    scores: dict[str, float | None] = {}
    best: tuple[float, float] | None = None
    for s in grid:
        try:
            stats = EmbeddingStats.from_vectors(fit, s)
        except ValueError:  # shrinkage 0 with fewer vectors than dimensions: singular
            scores[f"{s:g}"] = None
            continue
        acc = nn_accuracy(standardize(test, stats), labels)
        scores[f"{s:g}"] = round(acc, 4)
        if best is None or (acc, s) >= best:
            best = (acc, s)
    assert best is not None  # every grid above 0 gives a full-rank matrix
    return ShrinkageChoice(best[1], {"rule": rule, "grid": [float(s) for s in grid], "held_out_accuracy": scores,
                                     "fit_passages": int(fit.shape[0]), "held_out_passages": int(test.shape[0])})


@torch.no_grad()
def pooled_vectors(lm: ReformerLM, passages: list[tuple[str, np.ndarray]]) -> torch.Tensor:
    """(N, 2*hidden) float32 mean-pooled final hidden states (the service's "mean" pooling) of `passages`,
    one forward each."""
    lm = lm.eval()
    device = next(lm.parameters()).device
    return torch.stack([pool_hidden(lm.hidden(torch.from_numpy(ids).unsqueeze(0).to(device)), None, "mean")[0]
                        .float().cpu() for _, ids in passages])


@torch.no_grad()
def compute_embedding_stats(lm: ReformerLM, passages: list[tuple[str, np.ndarray]],
                            shrinkage: float | None = FALLBACK_SHRINKAGE) -> EmbeddingStats:
    """Mean, std and (unless `shrinkage` is None) whitening matrix of the mean-pooled final hidden states
    (what the service's "mean" pooling gives) of `passages`."""
    return EmbeddingStats.from_vectors(pooled_vectors(lm, passages), shrinkage)


def stats_for_export(lm: ReformerLM, tokenizer: Tokenizer, sources: list[str | Path] | None, val_fraction: float,
                     length: int = DEFAULT_PASSAGE_BYTES, count: int = DEFAULT_PASSAGES,
                     shrinkage: float | None = None) -> tuple[EmbeddingStats | None, dict[str, Any]]:
    """The statistics and the manifest's record of how they were computed, or (None, why they were not).
    `shrinkage` None: chosen by `select_shrinkage` on the same passages."""
    if not sources:
        return None, {"skipped": "no training data given (--eval-data): mean-pooled embeddings are served raw"}
    if count <= 0:
        return None, {"skipped": "turned off (--embed-stats-passages 0): mean-pooled embeddings are served raw"}
    length = min(length, int(lm.config.max_position_embeddings))
    cut = training_passages(sources, tokenizer, val_fraction, length, count)
    if len(cut) < 2:
        return None, {"skipped": f"fewer than two training passages in {[str(s) for s in sources]}"}
    vectors = pooled_vectors(lm, cut)
    names = [name for name, _ in cut]
    if shrinkage is None:
        choice = select_shrinkage(vectors, names)
        shrinkage, selection = choice.shrinkage, choice.record
    else:
        selection = {"rule": f"given ({shrinkage:g})"}
    stats = EmbeddingStats.from_vectors(vectors, shrinkage)
    files = sorted(set(names))
    return stats, {
        "file": STATS_FILE,
        "pooling": "mean",
        "what": whitening_what(shrinkage),
        "whitening_shrinkage": shrinkage,
        "shrinkage_selection": selection,
        "passages": len(cut),
        "passage_bytes": length,
        "bytes": int(sum(len(ids) for _, ids in cut)),
        "per_file": {f: names.count(f) for f in files},
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
