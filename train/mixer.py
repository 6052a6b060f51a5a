"""Training windows for the long-range recipe (train/recipe.py): prose windows, some of them turned into a
window holding one passkey or copy document, with a per-target mask naming the answer bytes' kind.

A window is a pure function of the prose drawn for it and the generator's state, like the prose sampler's
(train/data.py WindowSampler): every rank draws the same global batch and keeps its own rows, and a resumed
run draws what an uninterrupted one would."""

from __future__ import annotations

import math

import numpy as np

from .data import DataError, TokenFile, WindowSampler
from .long_docs import PASSKEY_OVERHEAD, SEP, LongDoc, copy_document, embed, passkey_parts, random_key
from .phases import Phase
from .recipe import KINDS, RecipeConfig, Stage

PROSE, PASSKEY, COPY = (KINDS.index(k) for k in ("prose", "passkey", "copy"))
_OFFSET = 2  # token id = byte + 2 (model.ByteTokenizer)


def recipe_stages(recipe: RecipeConfig, phases: list[Phase]) -> tuple[Stage, ...]:
    """The curriculum, or else one stage per phase with its window as the largest gap; every window must
    hold a document."""
    stages = recipe.curriculum or tuple(Stage(p.window, p.batch_size, p.window) for p in phases)
    for s in stages:
        if s.window < recipe.min_window():
            raise DataError(f"window {s.window} cannot hold a passkey or copy document: the recipe needs "
                            f"at least {recipe.min_window()} bytes")
    return stages


def stage_phases(stages: tuple[Stage, ...], max_steps: int | None) -> list[Phase]:
    """The stages as the trainer's phases (window and batch; the share is the stage's part of --max-steps
    where known, for the provenance only: a curriculum stage ends by step, not by share)."""
    out, start = [], 0
    for s in stages:
        end = s.until if s.until is not None else (max_steps or start)
        share = (end - start) / max_steps if max_steps else 0.0
        out.append(Phase(s.window, s.batch_size, max(share, 0.0)))
        start = end
    return out


def to_bytes(ids: np.ndarray) -> bytes:
    return (np.asarray(ids, dtype=np.int64) - _OFFSET).astype(np.uint8).tobytes()


def to_ids(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64) + _OFFSET


def draw_document(kind: int, prose: bytes, rng: np.random.Generator, stage: Stage, recipe: RecipeConfig
                  ) -> tuple[LongDoc, int]:
    """A document of `kind` fitting in `len(prose)` bytes with the separators, and its lead (prose bytes
    before it). The gap is drawn up to the stage's largest with a density growing toward it (u ** 0.5):
    far documents are the ones that need the LSH layers, near ones keep the short skill in the mix."""
    room = len(prose) - 2 * len(SEP)
    if kind == PASSKEY:
        hi = min(stage.gap, room - PASSKEY_OVERHEAD)
        gap = int(math.floor(hi * math.sqrt(rng.random())))
        left = room - PASSKEY_OVERHEAD - gap
        lead = int(rng.integers(0, left + 1))
        before = int(rng.integers(0, left - lead + 1))
        return passkey_parts(prose[lead:], random_key(rng), before, gap), lead
    n = recipe.copy_passage
    hi = min(stage.gap, room - 2 * n)
    gap = int(math.floor(hi * math.sqrt(rng.random())))
    lead = int(rng.integers(0, room - 2 * n - gap + 1))
    return copy_document(prose[lead:], n, gap, recipe.copy_cue), lead


def build_row(kind: int, ids: np.ndarray, rng: np.random.Generator, stage: Stage, recipe: RecipeConfig
              ) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of the window, kind code per target) from prose ids of `window + 1` tokens: the prose
    itself for PROSE, else a window with one document; target t predicts token t + 1, so the answer's bytes
    [a, b) are targets [a - 1, b - 1)."""
    mask = np.zeros(len(ids) - 1, dtype=np.int8)
    if kind == PROSE:
        return ids, mask
    prose = to_bytes(ids)
    doc, lead = draw_document(kind, prose, rng, stage, recipe)
    window, (a, b) = embed(doc, prose, lead, len(prose))
    mask[a - 1:b - 1] = kind
    return to_ids(window), mask


class MixedSampler:
    """Rows of prose (train/data.py WindowSampler), each then kept as prose or made into a document window,
    by the recipe's mix."""

    def __init__(self, data: TokenFile, stage: Stage, recipe: RecipeConfig, seed: int) -> None:
        self.prose = WindowSampler(data, stage.window, seed)
        self.stage, self.recipe = stage, recipe
        self.p = np.array(recipe.mix.probabilities())

    def rng(self, step: int, micro: int) -> np.random.Generator:
        return self.prose.rng(step, micro)

    def global_batch(self, rng: np.random.Generator, rows: int) -> tuple[np.ndarray, np.ndarray]:
        prose = self.prose.global_batch(rng, rows)
        kinds = rng.choice(len(KINDS), size=rows, p=self.p)
        out = [build_row(int(k), prose[i], rng, self.stage, self.recipe) for i, k in enumerate(kinds)]
        return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])


def heldout_rows(val: TokenFile, stage: Stage, recipe: RecipeConfig, kind: int
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The fixed held-out document windows of `kind` at the stage's window: prose from the validation tails
    (all of them end to end, repeated when shorter than a window), the same at every call for a seed."""
    pool = np.asarray(val.tokens, dtype=np.int64)
    if len(pool) == 0:
        return []
    need = stage.window + 1
    if len(pool) < need:
        pool = np.tile(pool, need // len(pool) + 1)
    rows = []
    for i in range(recipe.retrieval_val_docs):
        rng = np.random.default_rng([recipe.val_seed, stage.window, kind, i])
        start = int(rng.integers(0, len(pool) - need + 1))
        rows.append(build_row(kind, pool[start:start + need], rng, stage, recipe))
    return rows
