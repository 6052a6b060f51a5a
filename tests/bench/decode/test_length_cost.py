"""bench/decode/length_cost.py: the per-length summary, the bucket-boundary shift, and a tiny timed run."""

from __future__ import annotations

import pytest

import bench.decode.length_cost as length_cost
from tests.conftest import tiny_model


def test_summary_gives_means_medians_the_slowest_step_and_ratios() -> None:
    times = {100: [0.001, 0.003, 0.002, 0.002], 400: [0.002, 0.002, 0.010, 0.002]}  # 2 turns of 2 steps
    rows = length_cost.summarize(times, steps=2)
    assert [r["prompt"] for r in rows] == [100, 400]
    assert rows[0]["mean_ms"] == pytest.approx(2.0) and rows[0]["median_ms"] == pytest.approx(2.0)
    assert rows[1]["mean_ms"] == pytest.approx(4.0) and rows[1]["mean_vs_shortest"] == pytest.approx(2.0)
    # the slowest step of the 400-token prompt is turn 1's first timed step: turn 0 wrote position 400
    # (untimed), 401 and 402; turn 1 wrote 403 (untimed), then 404
    assert rows[1]["max_ms"] == pytest.approx(10.0) and rows[1]["max_at_position"] == 404
    assert rows[0]["max_at_position"] == 100 + 2  # turn 0, timed step 1


def test_a_length_whose_decoding_changes_the_bucket_count_moves_past_the_change() -> None:
    lm = tiny_model(num_buckets=None)  # chunks of 8: 2 * padded / 8 buckets, a power of two
    att = lm.layers[1].attention.self_attention
    cfg = lm.config
    change = next(n for n in range(100, 2000)
                  if att.num_buckets_for(cfg.padded_length(n)) != att.num_buckets_for(cfg.padded_length(n - 1)))
    assert length_cost.next_boundary_clear(lm, change - 5, 10) == change
    assert length_cost.next_boundary_clear(lm, change, 10) == change  # nothing to cross in its next 10
    assert length_cost.next_boundary_clear(tiny_model(), change - 5, 10) == change - 5  # fixed buckets


def test_every_length_gets_its_timed_steps() -> None:
    times = length_cost.time_lengths(tiny_model(), [20, 70], steps=3, rounds=2)
    assert sorted(times) == [20, 70]
    assert all(len(ts) == 6 and all(t > 0 for t in ts) for ts in times.values())
