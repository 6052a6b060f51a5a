"""model/decoding/steps/cuda_graphs.py: decode steps served through StepGraphs give the logits eager steps give, keys
are
warmed up, captured once and replayed, uncapturable steps (rows with different bucket counts) and failed
captures run eagerly, and graphs recorded against an LSH index that grew are dropped. On the CPU the
"capture" replays by calling the step again on the graph's own input buffers, which checks everything but
the CUDA graph itself (the GPU check runs that: bench/gpu/gpu_check.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from model import ReformerLM
from model.decoding import DecodeCache, Decoder, prefill
from model.decoding.steps.cuda_graphs import StepGraphs
from service.engine.runner import ModelRunner, step_graphs_for

from ..helpers import tiny_config


def _replay_by_calling(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    return fn


def _decode(lm: ReformerLM, lengths: list[int], steps: int, graphs: StepGraphs | None,
            invariant: bool = False) -> list[torch.Tensor]:
    """Greedy steps of every prompt together; the logits of each step (B, vocab)."""
    prompts = [torch.randint(3, 258, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    cache = DecodeCache.for_tokens(lm, max(lengths) + steps + 2, slots=len(lengths))
    decoder = Decoder(lm, cache)
    # the per-layer path, as on CUDA (the one-call step is CPU-only and runs outside the graphs)
    decoder.backends.fused = None
    logits, states = prefill(lm, cache, prompts, [n + steps + 1 for n in lengths])
    out = []
    for _ in range(steps):
        logits = decoder.step(logits.argmax(-1), states, invariant, graphs)
        out.append(logits)
    return out


@pytest.mark.parametrize("invariant", [False, True], ids=["bucketed", "invariant"])
def test_graph_steps_give_the_eager_logits(invariant: bool) -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3)).eval()  # fixed bucket count
    graphs = StepGraphs(capture=_replay_by_calling)
    # three rows padded to 4 (bucketed) or 16 (invariant blocks); the row short of a chunk attends densely at
    # first, then hashes
    lengths = [5, 19, 33]
    eager = _decode(lm, lengths, 12, None, invariant)
    replayed = _decode(lm, lengths, 12, graphs, invariant)
    for a, b in zip(eager, replayed, strict=True):
        assert torch.equal(a, b)
    # every key ran eagerly once, was captured the next time and replayed from then on
    assert graphs.captures == len(graphs.entries) and graphs.replays == 12 - len(graphs.entries)
    assert graphs.replays > 0 and all(e.seen >= 1 for e in graphs.entries.values())


def test_rows_with_different_bucket_counts_run_eagerly_and_growth_drops_old_graphs() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(attn_layers=["local", "lsh"], num_buckets=None, vocab_size=258,
                                initializer_range=0.3)).eval()
    graphs = StepGraphs(capture=_replay_by_calling)
    # 9 and 40 tokens hash with different automatic bucket counts: those steps are never captured
    mixed_eager = _decode(lm, [9, 40], 6, None)
    mixed = _decode(lm, [9, 40], 6, graphs)
    assert all(torch.equal(a, b) for a, b in zip(mixed_eager, mixed, strict=True))
    assert graphs.captures == 0 and graphs.replays == 0
    # one row crossing a bucket-count boundary: its index grows (reallocated), older graphs are dropped
    graphs = StepGraphs(capture=_replay_by_calling)
    eager = _decode(lm, [14], 40, None)
    replayed = _decode(lm, [14], 40, graphs)
    assert all(torch.equal(a, b) for a, b in zip(eager, replayed, strict=True))
    assert graphs.replays > 0
    assert len({k[1] for k in graphs.entries}) == 1  # only graphs of the index as it is now are kept


def test_a_failed_capture_is_logged_and_its_steps_run_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(vocab_size=258, initializer_range=0.3)).eval()

    def broken(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = StepGraphs(capture=broken)
    eager = _decode(lm, [20, 30], 6, None)
    with caplog.at_level("WARNING", logger="model.decoding.steps.cuda_graphs"):
        failing = _decode(lm, [20, 30], 6, graphs)
    assert all(torch.equal(a, b) for a, b in zip(eager, failing, strict=True))
    assert graphs.replays == 0 and all(e.failed for e in graphs.entries.values())
    assert sum("capturing the decode step" in r.message for r in caplog.records) == len(graphs.entries) == 1


def test_the_runner_uses_graphs_only_on_cuda() -> None:
    lm = ReformerLM(tiny_config(vocab_size=258)).eval()
    assert ModelRunner(lm, torch.device("cpu"), 4, 1 << 20, cuda_graphs=True).graphs is None
    assert isinstance(step_graphs_for(torch.device("cuda"), True), StepGraphs)  # builds no CUDA state
    assert step_graphs_for(torch.device("cuda"), False) is None
    given = StepGraphs(capture=_replay_by_calling)
    runner = ModelRunner(lm, torch.device("cpu"), 4, 1 << 20)
    runner.graphs = given
    logits, states = runner.prefill([[5, 6, 7, 8, 9, 10, 11, 12, 13]], [20])
    for _ in range(3):
        logits = runner.decode([int(logits[0].argmax())], states)
    # one key: eager, then captured and replayed, then replayed
    assert runner.graphs is given and given.replays == 2 and given.captures == 1
