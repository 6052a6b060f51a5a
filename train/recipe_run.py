"""What `reformer train` does differently with the long-range recipe on (train/recipe.py): which stage a
step trains, its windows and answer masks, the weighted loss, the answer bytes' loss kept apart, and the
held-out retrieval scores (with the curriculum's early advance) at each validation."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from model.config import ReformerConfig
from model.reformer import ReformerLM

from .data import Corpus
from .mixer import COPY, PASSKEY, MixedSampler, heldout_rows, recipe_stages, stage_phases
from .phases import Phase, phase_at
from .recipe import KINDS, RecipeConfig, Stage, lsh_reach, stage_at
from .runtime import DistInfo, all_reduce_sum

WeightedLossFn = Callable[[Tensor, int, Tensor], tuple[Tensor, Tensor]]
CURVE_FIELDS = ["stage", "window", "train_answer_loss", "train_passkey_loss", "train_copy_loss", "train_prose_loss",
                "val_passkey_acc", "val_passkey_loss", "val_copy_acc", "val_copy_loss"]


def make_weighted_loss_fn(model: torch.nn.Module, dtype: torch.dtype | None, device_type: str,
                          recipe: RecipeConfig) -> WeightedLossFn:
    """(ids (B, T+1), position offset, kinds (B, T)) -> (loss, per-target cross entropy, detached).
    loss = prose_weight x mean over every target + answer_weight x mean over the answer targets (kind > 0):
    an answer is 5 or 80 bytes of a window, so inside the plain mean its gradient would be ~1% of the step."""

    def loss_fn(ids: Tensor, offset: int, kinds: Tensor) -> tuple[Tensor, Tensor]:
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            logits = model(ids[:, :-1], position_offset=offset).logits  # (B, T, vocab)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                             reduction="none").view(kinds.shape)
        answer = (kinds > 0).to(ce.dtype)
        answer_mean = (ce * answer).sum() / answer.sum().clamp(min=1.0)  # 0 for a batch without answers
        return recipe.prose_weight * ce.mean() + recipe.answer_weight * answer_mean, ce.detach()

    return loss_fn


class AnswerMeter:
    """Per-byte training loss by kind (prose = every non-answer byte) summed since the last summary."""

    def __init__(self) -> None:
        self.sums = np.zeros(len(KINDS))
        self.counts = np.zeros(len(KINDS))

    def add(self, ce: Tensor, kinds: Tensor) -> None:
        for k in range(len(KINDS)):
            m = kinds == k
            self.sums[k] += float(ce[m].sum())
            self.counts[k] += float(m.sum())

    def summary(self, info: DistInfo, device: torch.device) -> dict[str, float | None]:
        total = all_reduce_sum([*self.sums.tolist(), *self.counts.tolist()], info, device)
        sums, counts = total[:len(KINDS)], total[len(KINDS):]
        self.sums[:], self.counts[:] = 0.0, 0.0

        def mean(s: float, c: float) -> float | None:
            return round(s / c, 4) if c else None

        return {"train_prose_loss": mean(sums[0], counts[0]),
                "train_passkey_loss": mean(sums[PASSKEY], counts[PASSKEY]),
                "train_copy_loss": mean(sums[COPY], counts[COPY]),
                "train_answer_loss": mean(sums[PASSKEY] + sums[COPY], counts[PASSKEY] + counts[COPY])}


def answer_spans(kinds: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, kind) of each run of equal nonzero codes in a window's mask: one per document's answer
    (answers are never adjacent: a separator or the repeat's cue lies between two)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], kinds.astype(np.int64), [0]])))
    return [(int(a), int(b), int(kinds[a])) for a, b in zip(edges[:-1], edges[1:], strict=True) if kinds[a] > 0]


@torch.no_grad()
def evaluate_answers(lm: ReformerLM, rows: list[tuple[np.ndarray, np.ndarray]], device: torch.device,
                     info: DistInfo, autocast: torch.dtype | None = None) -> tuple[float, float]:
    """(mean loss over the answer bytes in nats, accuracy) of document windows, teacher-forced: a passkey
    counts when the argmax is right at all five digits (what greedy decoding would then write), a copy
    byte when the argmax is that byte. Windows are shared out over ranks and the sums combined."""
    was_training = lm.training
    lm.eval()
    nll = count = right = docs = 0.0
    for ids_np, kinds_np in rows[info.rank::info.world_size]:
        ids = torch.from_numpy(ids_np).to(device).unsqueeze(0)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = lm(ids[:, :-1]).logits[0].float()
        m = torch.from_numpy(kinds_np > 0).to(device)
        nll += float(F.cross_entropy(logits[m], ids[0, 1:][m], reduction="sum"))
        count += float(m.sum())
        hits = (logits.argmax(-1) == ids[0, 1:]).cpu().numpy()
        for a, b, kind in answer_spans(kinds_np):
            if kind == PASSKEY:
                right, docs = right + float(hits[a:b].all()), docs + 1
            else:
                right, docs = right + float(hits[a:b].sum()), docs + (b - a)
    nll, count, right, docs = all_reduce_sum([nll, count, right, docs], info, device)
    lm.train(was_training)
    return (nll / count if count else math.nan), (right / docs if docs else math.nan)


class RecipeRun:
    def __init__(self, recipe: RecipeConfig, phases: list[Phase], corpus: Corpus, seed: int,
                 max_steps: int | None) -> None:
        self.recipe, self.corpus = recipe, corpus
        self.stages: tuple[Stage, ...] = recipe_stages(recipe, phases)
        self.phases = stage_phases(self.stages, max_steps) if recipe.curriculum else phases
        self.samplers = [MixedSampler(corpus.train, s, recipe, seed) for s in self.stages]
        self.meter = AnswerMeter()
        self._heldout: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}

    def index(self, step: int, progress: float, floor: int) -> int:
        if self.recipe.curriculum:
            return stage_at(self.stages, step, floor)
        return phase_at(self.phases, progress)

    def warnings(self, cfg: ReformerConfig) -> list[str]:
        """Stages longer than the model's LSH layers can reach (train/recipe.py lsh_reach)."""
        reach = lsh_reach(cfg.num_buckets, cfg.lsh_attn_chunk_length, cfg.lsh_num_chunks_before)
        if reach is None or "lsh" not in cfg.attn_layers:
            return []
        return [f"note: stage window {s.window} is beyond the LSH reach of {reach} positions (num_buckets "
                f"{cfg.num_buckets} x {cfg.lsh_num_chunks_before + 1} chunks x {cfg.lsh_attn_chunk_length}): "
                "gaps longer than that cannot be retrieved" for s in self.stages if s.window > reach]

    def heldout(self, stage: int, kind: int) -> list[tuple[np.ndarray, np.ndarray]]:
        key = (stage, kind)
        if key not in self._heldout:
            self._heldout[key] = heldout_rows(self.corpus.val, self.stages[stage], self.recipe, kind)
        return self._heldout[key]

    def validation(self, lm: ReformerLM, stage: int, floor: int, device: torch.device, info: DistInfo,
                   autocast: torch.dtype | None) -> tuple[dict[str, Any], int]:
        """The curve's recipe columns at a validation, and the stage floor after it: one more than `stage`
        when passkey accuracy at the next stage's window has reached --advance-at."""
        entry: dict[str, Any] = {"stage": stage, "window": self.stages[stage].window,
                                 **self.meter.summary(info, device)}
        for kind, name in ((PASSKEY, "passkey"), (COPY, "copy")):
            if self.recipe.retrieval_val_docs and self.recipe.mix.probabilities()[kind] > 0:
                loss, acc = evaluate_answers(lm, self.heldout(stage, kind), device, info, autocast)
                entry.update({f"val_{name}_loss": round(loss, 4), f"val_{name}_acc": round(acc, 4)})
        nxt = stage + 1
        if (self.recipe.advance_at and self.recipe.curriculum and nxt < len(self.stages)
                and self.recipe.retrieval_val_docs and self.recipe.mix.passkey > 0):
            _, acc = evaluate_answers(lm, self.heldout(nxt, PASSKEY), device, info, autocast)
            entry["next_stage_passkey_acc"] = round(acc, 4)
            if acc >= self.recipe.advance_at:
                floor = max(floor, nxt)
        return entry, floor

    def provenance(self) -> dict[str, Any]:
        return {**self.recipe.to_dict(), "stages": [asdict(s) for s in self.stages]}
