"""Training phases: a schedule of (window, batch) pairs sharing one run, e.g. many short windows first so the
model learns bytes and words quickly, then long windows so the LSH layers learn to use distant text.

    --phases 512x16:70%,16384x1:30%

Each phase is WINDOWxBATCH:SHARE; the shares split `--max-steps` (by optimizer steps) or, without it,
`--time-budget` (by wall time). The learning-rate schedule is one warm-up and one cosine over the whole
run, not one per phase."""

from __future__ import annotations

import re
from dataclasses import dataclass

_PHASE = re.compile(r"\s*(\d+)\s*x\s*(\d+)\s*(?::\s*([0-9]*\.?[0-9]+)\s*(%?))?\s*")


@dataclass(frozen=True)
class Phase:
    window: int
    batch_size: int
    share: float  # fraction of the run (steps or wall time), the shares sum to 1

    @property
    def tokens_per_micro_step(self) -> int:
        return self.window * self.batch_size


def parse_phases(text: str) -> list[Phase]:
    """'512x16:70%,4096x2:30%' -> phases; a share may be a percentage or a fraction, and one phase alone
    may omit it. Raises ValueError naming the bad part."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError("--phases is empty: give e.g. 512x16:70%,4096x2:30%")
    raw: list[tuple[int, int, float | None]] = []
    for part in parts:
        m = _PHASE.fullmatch(part)
        if m is None:
            raise ValueError(f"cannot read phase {part.strip()!r}: use WINDOWxBATCH:SHARE, e.g. 512x16:70%")
        window, batch = int(m.group(1)), int(m.group(2))
        if window < 2 or batch < 1:
            raise ValueError(f"phase {part.strip()!r}: the window must be >= 2 and the batch >= 1")
        share = None if m.group(3) is None else float(m.group(3)) / (100.0 if m.group(4) else 1.0)
        raw.append((window, batch, share))
    if len(raw) == 1 and raw[0][2] is None:
        return [Phase(raw[0][0], raw[0][1], 1.0)]
    if any(s is None for _, _, s in raw):
        raise ValueError("with several phases every phase needs a share, e.g. 512x16:70%,4096x2:30%")
    total = sum(s for _, _, s in raw if s is not None)
    if any(s is not None and s <= 0 for _, _, s in raw) or abs(total - 1.0) > 1e-6:
        raise ValueError(f"phase shares must be positive and add up to 100%, got {total:.2%}")
    return [Phase(w, b, float(s)) for w, b, s in raw if s is not None]


def phase_at(phases: list[Phase], progress: float) -> int:
    """Index of the phase that owns `progress` (0..1 of the run's steps or wall time)."""
    edge = 0.0
    for i, p in enumerate(phases):
        edge += p.share
        if progress < edge - 1e-12:
            return i
    return len(phases) - 1
