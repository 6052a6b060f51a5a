"""bench/prefill/extend_cost.py: a tiny run times both ways of prefilling and writes its table's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.prefill.extend_cost as extend_cost


def test_a_tiny_run_times_the_one_piece_prefill_and_the_extend(tmp_path: Path) -> None:
    book, out = tmp_path / "book.txt", tmp_path / "extend_cost.json"
    book.write_text("It was the best of times, it was the worst of times. " * 40)
    assert extend_cost.main(["--book", str(book), "--lengths", "100,70", "--reps", "2", "--threads", "1",
                             "--steps-up-to", "80", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["threads"] == 1 and len(result["load_before"]) == 3 and result["recent_size"] >= 64
    assert [(r["tokens"], r["reps"], len(r["prefill_s"]), len(r["extend_s"])) for r in result["rows"]] == [
        (100, 2, 2, 2), (70, 2, 2, 2)]
    for row in result["rows"]:
        assert row["prefill_tokens_per_s"] > 0 and row["extend_tokens_per_s"] > 0
        # the ratio is of the medians' times: their tokens/s, rounded to integers, give it within rounding
        ratio = row["extend_tokens_per_s"] / row["prefill_tokens_per_s"]
        assert row["extend_over_prefill"] == pytest.approx(ratio, rel=0.02)
    # one decode step per token only up to --steps-up-to
    assert "steps_s" not in result["rows"][0] and len(result["rows"][1]["steps_s"]) == 2
    assert result["rows"][1]["steps_tokens_per_s"] > 0
