"""How much ONNX verification an export can afford, by model size, and the progress shown while it runs.

Verification runs every case through the eager model and onnxruntime, so it costs about parameters x
tokens on each side. The full set (onnx_export.verification_cases with long=True: single rows up to
16,384 tokens and batches padded three ways, ~24K tokens for a small model) takes seconds at the default
artifact's 1M parameters and hours at google/reformer-enwik8's 150M on two cores (one 767-token row took
our eager model 43 s there). A model whose full set would exceed VERIFY_BUDGET parameter-tokens is verified
on the cases it can afford instead: always a one-token row and a right- and a both-side-padded batch of a row
that crosses a chunk boundary, pads and hashes (so every code path of the graph runs),
then the longer single rows while the budget lasts. The manifest says which (export.onnx.verification).

Such a model's graph is also exported without onnxscript's optimizer: its pattern rewriter is the largest
part of a many-layer export (12 layers at hidden 64, two shared cores: 188 s of a profiled 437 s export;
118 s for the whole export without it) and onnxruntime applies its own graph optimizations when it opens
the graph, so the unoptimized graph ran as fast there (1.9-2.3 s against 2.3 s for 2 x 1,031 tokens),
its logits within 3.6e-7 of torch's. google/reformer-enwik8's configuration at full width:
bench/import_hf/import_hf_enwik8.py.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from model import ReformerLM

from . import onnx_export as ox

# parameters x tokens per side: keeps the full set for models up to ~1.2M parameters (the default artifact's
# ~24K tokens); above that, the affordable subset
VERIFY_BUDGET = 3e10
log = logging.getLogger(__name__)


@dataclass
class VerificationPlan:
    cases: list[tuple[Tensor, Tensor]] | None  # None: the full set (verification_cases, long=True)
    optimize: bool  # run onnxscript's optimizer on the exported graph
    record: dict[str, Any]  # what the manifest says about the choice


def case_tokens(cases: list[tuple[Tensor, Tensor]]) -> int:
    return sum(int(ids.numel()) for ids, _ in cases)


def affordable_cases(model: ReformerLM, seed: int, tokens: int) -> list[tuple[Tensor, Tensor]]:
    """The core cases (every graph path: dense one-token row, right- and both-side-padded batches of a row
    that pads, crosses a chunk and hashes with a row shorter than a chunk), then longer single rows while
    their tokens fit in `tokens`. The long row is not verified alone as well: the graph has no branch on the
    batch, and the right-padded batch's first row is that row unpadded (at google/reformer-enwik8's size the
    separate case cost 8 s of a two-minute import)."""
    cfg = model.config
    m = math.lcm(*cfg.chunk_lengths())
    top = ox.max_export_length(model)
    g = torch.Generator().manual_seed(seed)
    n, short = min(m + 3, top), max(1, m // 2)
    cases = []
    ids = torch.randint(2, cfg.vocab_size, (1, 1), generator=g)
    cases.append((ids, torch.ones_like(ids)))
    if n > short + 1:
        cases.append(ox.padded_batch([(0, n, 0), (0, short, n - short)], cfg.vocab_size, cfg.pad_token_id, g))
        cases.append(ox.padded_batch([(0, n, 0), (n - short - 1, short, 1)], cfg.vocab_size, cfg.pad_token_id, g))
    else:  # too short to pad a batch around: the row alone
        ids = torch.randint(2, cfg.vocab_size, (1, n), generator=g)
        cases.append((ids, torch.ones_like(ids)))
    spent = case_tokens(cases)
    for length in sorted({min(k, top) for k in (3 * m - 1, 6 * m + 5, ox.LONG_LENGTH, ox.LONGER_LENGTH)} - {n}):
        if spent + length > tokens:
            break
        ids = torch.randint(2, cfg.vocab_size, (1, length), generator=g)
        cases.append((ids, torch.ones_like(ids)))
        spent += length
    return cases


def plan_verification(model: ReformerLM, seed: int = 0, budget: float | None = None) -> VerificationPlan:
    """The full set when parameters x its tokens fit `budget` (default VERIFY_BUDGET), else the affordable
    cases, exported without the optimizer."""
    budget = VERIFY_BUDGET if budget is None else budget
    params = model.num_parameters()
    full = case_tokens(ox.verification_cases(model, seed, long=True))
    record: dict[str, Any] = {"parameters": params, "budget_parameter_tokens": budget, "full_tokens": full}
    if params * full <= budget:
        return VerificationPlan(None, True, {**record, "scope": "full", "tokens": full})
    cases = affordable_cases(model, seed, int(budget // params))
    longest = max(int(mask.sum(dim=1).max()) for _, mask in cases)
    record.update(scope="reduced", tokens=case_tokens(cases), longest=longest, why=(
        f"{params:,} parameters x {full:,} tokens of the full verification exceed the budget of {budget:.0e} "
        f"parameter-tokens: verified on the cases this size affords, up to {longest} tokens (a one-token row, "
        "right- and both-side-padded batches of a row that pads, crosses a chunk and hashes); graph "
        "exported without onnxscript's optimizer (onnxruntime optimizes it when it opens it)"))
    return VerificationPlan(cases, False, record)


@contextmanager
def progress(model: ReformerLM, cases: int) -> Iterator[None]:
    """A bar over the export (shown with its elapsed time while it runs, refreshed every second) and the
    verification cases (one tick per eager forward, each case's length shown); on a terminal only."""
    bar = tqdm(total=cases + 1, desc="ONNX export", unit="step", disable=None, leave=False)
    done = threading.Event()

    def tick(module: torch.nn.Module, args: Any, output: Any) -> None:
        if bar.n == 0:
            bar.update(1)  # the first eager forward is verification's: the export is done
        bar.set_description(f"ONNX verification at {tuple(args[0].shape)}")
        bar.update(1)

    def refresh() -> None:
        while not done.wait(1.0):
            bar.refresh()

    handle = model.register_forward_hook(tick)
    thread = threading.Thread(target=refresh, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        handle.remove()
        bar.close()


def export_sized(model: ReformerLM, path: Path, seed: int = 0) -> dict[str, Any]:
    """onnx_export.export_and_verify on the cases the model can afford (plan_verification), with progress;
    returns its manifest record with the plan under "verification"."""
    plan = plan_verification(model, seed)
    count = len(plan.cases) if plan.cases is not None else len(ox.verification_cases(model, seed, long=True))
    log.info("exporting the ONNX graph, then verifying it on %d cases (%s, %d tokens)", count,
                plan.record["scope"], plan.record["tokens"])
    start = time.perf_counter()
    with progress(model, count):
        info = ox.export_and_verify(model, path, cases=plan.cases, optimize=plan.optimize)
    log.info("ONNX export and verification took %.0f s", time.perf_counter() - start)
    info["verification"] = plan.record
    return info
