"""Training windows for the long-range recipe (train/recipe.py): prose windows, some of them turned into a
window of passkey or copy documents, with a per-target mask naming the answer bytes' kind.

A window is a pure function of the prose drawn for it and the generator's state, like the prose sampler's
(train/data.py WindowSampler): every rank draws the same global batch and keeps its own rows, and a resumed
run draws what an uninterrupted one would."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .data import DataError, TokenFile, WindowSampler
from .long_docs import (
    PASSKEY_OVERHEAD,
    SEP,
    LongDoc,
    copy_document,
    log_uniform_gap,
    passkey_parts,
    random_key,
    random_passage,
    repeat_document,
    standard_filler,
)
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


def draw_gap(rng: np.random.Generator, hi: int, recipe: RecipeConfig) -> int:
    """A gap of at most `hi` bytes by the recipe's draw: log-uniform from --gap-min (near gaps, inside the local
    window, as common as far ones), or the older square-root draw (density growing toward `hi`)."""
    if recipe.gap_draw == "sqrt":
        return int(math.floor(max(hi, 0) * math.sqrt(rng.random())))
    return log_uniform_gap(rng, min(recipe.gap_min, max(hi, 0)), hi)


def smallest_document(kind: int, recipe: RecipeConfig) -> int:
    """Bytes of the shortest document of `kind` (no gap) with its two separators."""
    body = PASSKEY_OVERHEAD if kind == PASSKEY else 2 * recipe.copy_passage_min
    return body + 2 * len(SEP)


def draw_document(kind: int, prose: bytes, rng: np.random.Generator, stage: Stage, recipe: RecipeConfig,
                  room: int | None = None) -> tuple[LongDoc, int]:
    """A document of `kind` fitting in `room` bytes (default `len(prose)`) with the separators, and its lead
    (prose bytes before it, up to the spare room, or a quarter of it with --pack). Its filler and gap prose
    come from `prose[lead:]`; a passkey's filler is the standard lines instead for a `passkey_standard`
    share, a copy passage random bytes for `copy_random`."""
    room = (len(prose) if room is None else room) - 2 * len(SEP)
    spread = 4 if recipe.pack else 1  # packed: leave most of the spare room to the documents after this one
    if kind == PASSKEY:
        gap = draw_gap(rng, min(stage.gap, room - PASSKEY_OVERHEAD), recipe)
        left = room - PASSKEY_OVERHEAD - gap
        lead = int(rng.integers(0, left // spread + 1))
        before = int(rng.integers(0, (left - lead) // spread + 1))
        key = random_key(rng)
        if rng.random() < recipe.passkey_standard:
            doc = passkey_parts(standard_filler(before + gap), key, before, gap)
            return replace(doc, prose_used=0), lead
        return passkey_parts(prose[lead:], key, before, gap), lead
    n = int(rng.integers(recipe.copy_passage_min, min(recipe.copy_passage, room // 2) + 1))
    gap = draw_gap(rng, min(stage.gap, room - 2 * n), recipe)
    lead = int(rng.integers(0, (room - 2 * n - gap) // spread + 1))
    cue = min(recipe.copy_cue, n - 1)
    if rng.random() < recipe.copy_random:
        return repeat_document(random_passage(rng, n), prose[lead:], gap, cue), lead
    return copy_document(prose[lead:], n, gap, cue), lead


def build_row(kind: int, ids: np.ndarray, rng: np.random.Generator, stage: Stage, recipe: RecipeConfig
              ) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of the window, kind code per target) from prose ids of `window + 1` tokens: the prose
    itself for PROSE, else a window of documents of `kind` (one, or with --pack as many as fit, each after
    its own stretch of prose), the rest prose. Target t predicts token t + 1, so an answer's bytes [a, b)
    are targets [a - 1, b - 1)."""
    mask = np.zeros(len(ids) - 1, dtype=np.int8)
    if kind == PROSE:
        return ids, mask
    prose = to_bytes(ids)
    total = len(prose)
    window, src = b"", 0  # src: prose bytes used so far (never more than the window holds)
    while total - len(window) >= smallest_document(kind, recipe) and (recipe.pack or not window):
        doc, lead = draw_document(kind, prose[src:], rng, stage, recipe, room=total - len(window))
        head = prose[src:src + lead] + (SEP if window or lead else b"")
        at = len(window) + len(head)
        window += head + doc.data + SEP
        src += lead + doc.prose_used
        mask[at + doc.answer[0] - 1:at + doc.answer[1] - 1] = kind
    window = (window + prose[src:])[:total]
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
