"""The long-range recipe of `reformer train`: training windows that need long context (passkey and copy
documents, train/long_docs.py) mixed with plain prose, a curriculum from short windows and gaps to long
ones, and a separate weight on the loss of the answer bytes. Off unless --mix or --curriculum is given;
then the run's curve.csv also carries the answer bytes' loss apart from the prose's.

    reformer train --init-from export/default_artifact --successor-heads 4 --out runs/lr --random-offsets \
        --mix passkey=0.3,copy=0.4,prose=0.3 --answer-weight 1 \
        --curriculum 2048x4:600,4096x2:1200,16384x1:1600,65536x1 --advance-at 0.9

Why this shape: the retrieval circuit formed within minutes only when answers were dense (every window a
document, about half the gradient on the answer), and failed at any other length when the question always
sat at one position, so documents go anywhere in the window (several to a window with --pack) and the key
anywhere in the document. Gaps are drawn log-uniformly from --gap-min up to the stage's largest, so a
match inside the local window is trained as often as a far one. Copy passages are prose and random bytes of
several lengths: a random passage can only be predicted from its first occurrence, which is what the
successor-value heads (--successor-heads) read. Passkey filler is prose or the standard repeated lines.
Stages double the length; with --advance-at a stage ends early once greedy passkey accuracy at the next
stage's window reaches that share (checked at validation)."""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .long_docs import PASSKEY_OVERHEAD, SEP

KINDS = ("prose", "passkey", "copy")  # index = the kind code in a window's mask (0: not an answer byte)
_STAGE = re.compile(r"\s*(\d+)\s*x\s*(\d+)\s*(?:@\s*(\d+))?\s*(?::\s*(\d+))?\s*")


@dataclass(frozen=True)
class Stage:
    """Windows of `window` bytes, `batch_size` per micro-step, with at most `gap` bytes between a key (or a
    passage) and its question (or repeat), until optimizer step `until` (None: to the end of the run)."""

    window: int
    batch_size: int
    gap: int
    until: int | None = None


@dataclass(frozen=True)
class Mix:
    """Shares of the training windows (rows) by kind; they add up to 1."""

    passkey: float = 0.4
    copy: float = 0.3
    prose: float = 0.3

    def probabilities(self) -> list[float]:
        return [self.prose, self.passkey, self.copy]  # in KINDS order


@dataclass(frozen=True)
class RecipeConfig:
    mix: Mix = field(default_factory=Mix)
    answer_weight: float = 1.0  # loss = prose_weight * mean(all bytes) + answer_weight * mean(answer bytes)
    prose_weight: float = 1.0  # 0: answers only (the densest signal, for a first short stage)
    curriculum: tuple[Stage, ...] = ()  # empty: the run's --phases / --window, each with its window as the gap
    copy_passage: int = 160  # longest copy passage (bytes): the cue and then the scored bytes
    copy_passage_min: int = 24  # shortest; each document draws its length uniformly in between
    copy_cue: int = 2  # bytes of the repeat before its scored bytes (at most the passage less one)
    copy_random: float = 0.5  # share of copy passages made of random printable bytes (the rest: prose)
    passkey_standard: float = 0.5  # share of passkey documents with the standard filler (the rest: prose)
    gap_min: int = 8  # shortest gap; gaps are drawn log-uniformly (`gap_draw`) from it up to the stage's
    gap_draw: str = "log"  # "log": log-uniform; "sqrt": the older draw, density growing toward the largest
    pack: bool = True  # a document window holds as many documents as fit (False: one)
    advance_at: float = 0.0  # passkey accuracy at the next stage's window that ends a stage early (0: off)
    retrieval_val_docs: int = 16  # fixed held-out document windows of each kind scored at every validation
    val_seed: int = 1234  # the held-out documents' seed: the same documents at every validation and run

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def min_window(self) -> int:
        """The shortest window that holds a passkey document or the longest copy document with no gap."""
        need = [PASSKEY_OVERHEAD * (self.mix.passkey > 0), 2 * self.copy_passage * (self.mix.copy > 0)]
        return max(need) + 2 * len(SEP)


def parse_mix(text: str) -> Mix:
    """'passkey=0.3,copy=0.2,prose=0.5' -> Mix; kinds left out get 0; the shares must add up to 1."""
    shares: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, eq, value = part.partition("=")
        if not eq or name.strip() not in KINDS:
            raise argparse.ArgumentTypeError(f"cannot read {part!r}: use e.g. passkey=0.3,copy=0.2,prose=0.5")
        try:
            shares[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: the share must be a number") from None
    if any(v < 0 for v in shares.values()) or abs(sum(shares.values()) - 1.0) > 1e-6:
        raise argparse.ArgumentTypeError(f"--mix shares must be >= 0 and add up to 1, got {text!r}")
    return Mix(**{k: shares.get(k, 0.0) for k in KINDS})


def parse_curriculum(text: str) -> tuple[Stage, ...]:
    """'512x8@256:400,1024x4:1600,2048x2' -> stages: WINDOWxBATCH[@GAP][:UNTIL_STEP], the last without UNTIL
    (it runs to the end); GAP defaults to the window. Ends must increase."""
    stages: list[Stage] = []
    parts = [p for p in text.split(",") if p.strip()]
    for i, part in enumerate(parts):
        m = _STAGE.fullmatch(part)
        if m is None:
            raise argparse.ArgumentTypeError(f"cannot read stage {part.strip()!r}: use WINDOWxBATCH[@GAP][:UNTIL]")
        window, batch = int(m.group(1)), int(m.group(2))
        gap = int(m.group(3)) if m.group(3) else window
        until = int(m.group(4)) if m.group(4) else None
        last = i == len(parts) - 1
        if until is None and not last:
            raise argparse.ArgumentTypeError(f"stage {part.strip()!r}: every stage but the last needs :UNTIL_STEP")
        if until is not None and stages and (stages[-1].until or 0) >= until:
            raise argparse.ArgumentTypeError(f"stage {part.strip()!r}: its end must be after the stage before's")
        if window < 2 or batch < 1:
            raise argparse.ArgumentTypeError(f"stage {part.strip()!r}: the window must be >= 2, the batch >= 1")
        stages.append(Stage(window, batch, gap, until))
    if not stages:
        raise argparse.ArgumentTypeError("--curriculum is empty")
    return tuple(stages)


def parse_length_range(text: str) -> tuple[int, int]:
    """'140' -> (140, 140); '24-160' -> (24, 160): the copy passage's shortest and longest length."""
    lo, dash, hi = text.strip().partition("-")
    try:
        a, b = int(lo), int(hi) if dash else int(lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: use a length (140) or a range (24-160)") from None
    if a < 2 or b < a:
        raise argparse.ArgumentTypeError(f"{text!r}: lengths must be >= 2 and the range increasing")
    return a, b


def stage_at(stages: tuple[Stage, ...], step: int, floor: int = 0) -> int:
    """The stage that owns optimizer step `step`; never earlier than `floor` (a stage reached early)."""
    for i, s in enumerate(stages):
        if s.until is None or step < s.until:
            return max(i, floor)
    return len(stages) - 1


def add_recipe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("long-range recipe (train/recipe.py; on when --mix or --curriculum is given)")
    g.add_argument("--mix", type=parse_mix,
                   help="shares of windows by kind, e.g. passkey=0.4,copy=0.3,prose=0.3 (the default once the "
                        "recipe is on)")
    g.add_argument("--curriculum", type=parse_curriculum,
                   help="stages WINDOWxBATCH[@GAP][:UNTIL_STEP],... e.g. 512x8@256:400,1024x4:1600,4096x1 "
                        "(replaces --phases; default: the phases, each window its own largest gap)")
    g.add_argument("--answer-weight", type=float, default=1.0,
                   help="weight of the answer bytes' mean loss, added to the mean loss over all bytes")
    g.add_argument("--prose-weight", type=float, default=1.0,
                   help="weight of the mean loss over all bytes (0: train on the answer bytes only)")
    g.add_argument("--copy-passage", type=parse_length_range, default=(24, 160), metavar="MIN-MAX",
                   help="bytes of a copy document's passage: a length, or a range each document draws from")
    g.add_argument("--copy-cue", type=int, default=2,
                   help="bytes of the repeat before its scored bytes (less than the shortest passage)")
    g.add_argument("--copy-random", type=float, default=0.5,
                   help="share of copy passages of random printable bytes (the rest are prose)")
    g.add_argument("--passkey-standard", type=float, default=0.5,
                   help="share of passkey documents whose filler is the standard repeated lines ('The grass is "
                        "green...'; the rest have prose)")
    g.add_argument("--gap-min", type=int, default=8, help="shortest gap between a key or passage and its repeat")
    g.add_argument("--gap-draw", choices=["log", "sqrt"], default="log",
                   help="gap distribution up to the stage's largest: log-uniform from --gap-min, or the older "
                        "square-root draw (density growing toward the largest)")
    g.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="fill a document window with as many documents as fit (--no-pack: one a window)")
    g.add_argument("--advance-at", type=float, default=0.0,
                   help="end a curriculum stage early when greedy passkey accuracy on held-out documents at the "
                        "next stage's window reaches this share, checked at each validation (0: by step only)")
    g.add_argument("--retrieval-val-docs", type=int, default=16,
                   help="held-out passkey and copy documents (each) scored at every validation")


def recipe_from_args(args: argparse.Namespace) -> RecipeConfig | None:
    """The recipe the options describe, or None when it is off (then training is exactly as without it)."""
    if args.mix is None and args.curriculum is None:
        return None
    if args.curriculum is not None and args.phases is not None:
        raise ValueError("--curriculum replaces --phases: give one of them")
    if args.answer_weight < 0 or args.prose_weight < 0 or args.answer_weight + args.prose_weight == 0:
        raise ValueError("--answer-weight and --prose-weight must be >= 0 and not both 0")
    shortest, longest = args.copy_passage
    if not 0 <= args.copy_cue < shortest:
        raise ValueError(f"--copy-cue {args.copy_cue} must be in [0, the shortest --copy-passage {shortest})")
    for name in ("copy_random", "passkey_standard", "advance_at"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.gap_min < 0:
        raise ValueError(f"--gap-min must be >= 0, got {args.gap_min}")
    recipe = RecipeConfig(mix=args.mix or Mix(), answer_weight=args.answer_weight, prose_weight=args.prose_weight,
                          curriculum=args.curriculum or (), copy_passage=longest, copy_passage_min=shortest,
                          copy_cue=args.copy_cue, copy_random=args.copy_random,
                          passkey_standard=args.passkey_standard, gap_min=args.gap_min, gap_draw=args.gap_draw,
                          pack=args.pack, advance_at=args.advance_at, retrieval_val_docs=args.retrieval_val_docs)
    for s in recipe.curriculum:
        if s.window < recipe.min_window():
            raise ValueError(f"--curriculum window {s.window} cannot hold a document: the recipe needs at least "
                             f"{recipe.min_window()} bytes")
    return recipe


def lsh_reach(num_buckets: int | list[int] | None, chunk: int, chunks_before: int) -> int | None:
    """How far back (positions) an LSH query can find a match: with B buckets a match D positions back stays
    in the query's window while D < B x (chunks before + 1) x chunk. None: buckets scale with the length."""
    if num_buckets is None:
        return None
    b = num_buckets if isinstance(num_buckets, int) else _product(num_buckets)
    return b * (chunks_before + 1) * chunk


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out
