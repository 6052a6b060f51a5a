"""The causal prefill's scores (service/engine/runner.py `extend_slices(score=k)`): however the prompt is cut into
slices (slice_tokens, the stops where the prefix cache copies the state, SCORE_ROWS), row t scores prompt token
t+1 from the logits of the decode step that reads token t, with PromptScores' shapes and dtypes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service.engine.runner import ModelRunner
from tests.conftest import tiny_model
from tests.service.helpers import stepped_logprobs


def _read(runner: ModelRunner, ids: list[int], k: int, **kw: Any) -> tuple[torch.Tensor, Any, list[int]]:
    steps = runner.extend_slices(ids, len(ids) + 4, score=k, **kw)
    lengths = []
    while True:
        try:
            lengths.append(next(steps)[0])
        except StopIteration as done:
            logits, state, scores = done.value
            runner.free(state)
            return logits, scores, lengths


@pytest.mark.parametrize(("slice_tokens", "stops"), [(1024, ()), (37, ()), (64, (5, 64, 100))])
def test_scores_are_the_steps_in_any_slices(slice_tokens: int, stops: tuple[int, ...]) -> None:
    lm = tiny_model()
    runner = ModelRunner(lm, torch.device("cpu"), 2, 64 << 20)
    ids = torch.randint(3, 258, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    logits, scores, lengths = _read(runner, ids, 3, slice_tokens=slice_tokens, stops=stops)
    assert lengths[-1] == len(ids) and set(stops) <= set(lengths)
    want = stepped_logprobs(lm, ids)
    assert scores.logprobs.dtype == torch.float32 and scores.logprobs.shape == (len(ids) - 1,)
    assert torch.equal(scores.logprobs, want[:-1].gather(-1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(-1))
    values, top = want[:-1].topk(3, dim=-1)
    assert scores.top_ids.dtype == torch.int64 and torch.equal(scores.top_ids, top)
    assert torch.equal(scores.top_logprobs, values)
    assert torch.equal(torch.log_softmax(logits, dim=-1), want[-1])  # the first token's logits: the last row's


def test_unscored_reads_return_no_scores_and_scored_ones_start_at_zero() -> None:
    runner = ModelRunner(tiny_model(), torch.device("cpu"), 2, 64 << 20)
    ids = list(range(10, 40))
    _, scores, _ = _read(runner, ids, None)  # type: ignore[arg-type]
    assert scores is None
    _, one, _ = _read(runner, ids[:1], 2)
    assert one.logprobs.shape == (0,) and one.top_ids.shape == (0, 2) and one.top_logprobs.shape == (0, 2)
    state = runner.allocate(40)
    with pytest.raises(ValueError, match="position 0"):
        next(runner.extend_slices(ids, 40, state, score=1))
    runner.free(state)
