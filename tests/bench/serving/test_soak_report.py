"""bench/serving/soak_report.py's summaries over fake series, and bench/serving/soak_load.py's mix (no server)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.serving.soak_load import LONG_BYTES, SHORT_BYTES, Prompts, plan
from bench.serving.soak_report import (
    OK,
    SERVER_ERROR,
    TIMEOUT,
    TRANSPORT,
    TRUNCATED,
    UNEXPECTED,
    Record,
    error_counts,
    idle_growth,
    memory_reading,
    memory_sample,
    parse_series,
    percentile,
    value_at,
    verdict,
    windows,
)

METRICS = """# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 9.0e+08
reformer_heap_in_use_bytes 4.0e+08
reformer_heap_trims_total{reason="idle"} 3.0
reformer_heap_trims_total{reason="budget"} 0.0
reformer_queue_size{kind="embed"} 0.0
reformer_queue_size{kind="generate"} 2.0
reformer_decode_cache_bytes{state="allocated"} 1024.0
reformer_decode_cache_bytes{state="capacity"} 4096.0
"""


def test_a_sample_reads_the_series_and_leaves_absent_ones_none() -> None:
    sample = memory_sample(METRICS, 12.34567)
    assert sample["t_s"] == 12.346 and sample["rss_bytes"] == 9.0e8 and sample["heap_in_use_bytes"] == 4.0e8
    assert sample["heap_trims_idle"] == 3 and sample["heap_trims_budget"] == 0
    assert sample["queued_generate"] == 2 and sample["decode_cache_allocated_bytes"] == 1024
    assert sample["live_tensor_bytes"] is None and sample["heap_free_retained_bytes"] is None
    assert parse_series("garbage line\nname{a=\"b\"} notanumber\n") == {}


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 51 and percentile(values, 0.99) == 99 and percentile(values, 1.0) == 100
    assert percentile([], 0.5) is None and percentile([3.0], 0.99) == 3.0


def _records() -> list[Record]:
    # 30 s run, windows of 10 s: latencies 0.1 in the first, 0.2 in the second, 0.3 in the last
    records = [Record("embed", w * 10 + j * 0.1, 0.1 * (w + 1), OK) for w in range(3) for j in range(50)]
    records += [Record("generate", 25.0, 9.9, SERVER_ERROR), Record("stream_full", 31.0, 0.3, OK),
                Record("long_generate", 15.0, 0.2, TIMEOUT)]
    return records


def test_windows_give_percentiles_of_the_answered_requests_per_window_and_kind() -> None:
    wins = windows(_records(), window_s=10, duration_s=30)
    assert [(w["start_s"], w["end_s"]) for w in wins] == [(0, 10), (10, 20), (20, 30)]
    assert [w["count"] for w in wins] == [50, 50, 51]  # the stream ending after the run joins the last
    assert [w["p99_s"] for w in wins] == pytest.approx([0.1, 0.2, 0.3])  # the 5xx's 9.9 s is not a latency
    assert wins[2]["outcomes"] == {OK: 51, SERVER_ERROR: 1} and wins[1]["outcomes"] == {OK: 50, TIMEOUT: 1}
    assert set(wins[2]["by_kind"]) == {"embed", "stream_full"} and wins[2]["by_kind"]["embed"]["count"] == 50
    short = windows(_records()[:10], window_s=600, duration_s=120)  # a run shorter than a window: one window
    assert len(short) == 1 and short[0]["end_s"] == 120


def test_error_counts_name_every_outcome_and_sum_the_lost() -> None:
    records = [Record("x", 1, 1, o) for o in (OK, OK, UNEXPECTED, SERVER_ERROR, TRANSPORT, TIMEOUT, TRUNCATED)]
    counts = error_counts(records)
    assert counts == {OK: 2, UNEXPECTED: 1, SERVER_ERROR: 1, TRANSPORT: 1, TIMEOUT: 1, TRUNCATED: 1, "lost": 3,
                      "requests": 7}
    assert error_counts([])["lost"] == 0


def _samples(rss: list[float], in_use: list[float]) -> list[dict[str, float | None]]:
    return [{"t_s": 10.0 * i, "rss_bytes": r, "heap_in_use_bytes": u} for i, (r, u) in enumerate(zip(rss, in_use))]


def test_value_at_takes_the_first_sample_at_or_after() -> None:
    samples = _samples([1, 2, 3, 4], [1, 1, 1, 1])
    assert value_at(samples, 10, "rss_bytes") == 2 and value_at(samples, 11, "rss_bytes") == 3
    assert value_at(samples, 99, "rss_bytes") == 4 and value_at(samples, 0, "python_objects") is None


def test_verdict_against_the_targets() -> None:
    # 60 s run: reference at 10 s (sample 1), end at 60 s (sample 6)
    flat = _samples([800, 1000, 1010, 1020, 1030, 1040, 1050], [400] * 7)
    wins = [{"p99_s": 0.5}, {"p99_s": 1.0}, {"p99_s": 1.1}]
    errors = {SERVER_ERROR: 0, "lost": 0}
    good = verdict(flat, wins, errors, 60)
    assert good["rss_reference_bytes"] == 1000 and good["rss_end_bytes"] == 1050
    assert good["rss_ratio"] == pytest.approx(1.05) and good["p99_ratio"] == pytest.approx(1.1)
    assert good["passed"] and good["reading"].startswith("RSS flat under load")
    grown = verdict(_samples([800, 1000, 1100, 1200, 1300, 1400, 1500], [400] * 7), wins, errors, 60)
    assert not grown["checks"]["rss_growth_within_5pct"] and not grown["passed"]
    assert grown["reading"].startswith("RSS grew 50% under load")
    slow = verdict(flat, [*wins[:2], {"p99_s": 1.3}], errors, 60)
    assert not slow["checks"]["p99_last_within_1_2x_of_second_window"]
    assert not verdict(flat, wins, {SERVER_ERROR: 1, "lost": 0}, 60)["passed"]
    assert not verdict(flat, wins, {SERVER_ERROR: 0, "lost": 2}, 60)["passed"]
    too_few = verdict(flat, wins[:2], errors, 60)  # two windows: p99 cannot be judged, so no pass
    assert too_few["p99_ratio"] is None and not too_few["passed"]
    assert not verdict([], wins, errors, 60)["passed"]  # no samples: no pass


MB = 2**20


def test_idle_to_idle_growth_tells_a_leak_from_retention_and_the_cache_high_water_mark() -> None:
    before = {"rss_bytes": 400 * MB, "heap_in_use_bytes": 130 * MB, "python_objects": 260_000,
              "live_tensor_resident_bytes": 20 * MB, "heap_mapped_bytes": 140 * MB}
    retained = {**before, "rss_bytes": 700 * MB, "heap_in_use_bytes": 131 * MB, "heap_mapped_bytes": 440 * MB}
    flat = _samples([800 * MB] * 7, [400 * MB] * 7)
    wins = [{"p99_s": 1.0}] * 3
    v = verdict(flat, wins, {SERVER_ERROR: 0, "lost": 0}, 60, before, retained)
    assert v["idle_to_idle_growth"]["heap_in_use_bytes"] == 1 * MB and v["rss_after_idle_bytes"] == 700 * MB
    assert v["idle_to_idle_growth"]["python_objects"] == 0
    assert "idle trim gave back 100 MB" in v["reading"] and "no leak in malloc'd memory" in v["reading"]
    leaked = {**retained, "heap_in_use_bytes": 300 * MB, "python_objects": 300_000}
    reading = verdict(flat, wins, {}, 60, before, leaked)["reading"]
    assert "heap in-use grew 170 MB idle to idle" in reading and "Python objects grew by 40000" in reading
    cache = {**retained, "live_tensor_resident_bytes": 220 * MB}
    assert "resident tensor pages grew 200 MB" in verdict(flat, wins, {}, 60, before, cache)["reading"]
    assert "no idle-to-idle heap figures" in verdict(flat, wins, {}, 60)["reading"]
    assert idle_growth({"rss_bytes": 1}, {})["rss_bytes"] is None
    assert memory_reading(None, None, None, {}, {}) == "no RSS samples"


def test_samples_after_the_run_are_not_its_end() -> None:
    samples = [*_samples([900, 1000, 1000, 1000, 1000, 1000, 1000], [1] * 7), {"t_s": 75.0, "rss_bytes": 500.0}]
    assert verdict(samples, [{"p99_s": 1.0}] * 3, {SERVER_ERROR: 0, "lost": 0}, 60)["rss_end_bytes"] == 1000


def test_the_mix_is_deterministic_and_its_prompts_keep_their_sizes(tmp_path: Path) -> None:
    rng = random.Random(0)
    (tmp_path / "book.txt").write_text("".join(rng.choice("abcdefgh ") for _ in range(200_000)))
    prompts = Prompts([tmp_path, tmp_path / "missing"])
    plans = [plan(i, prompts, long_every=50, longest=60_000) for i in range(400)]
    assert plans == [plan(i, prompts, long_every=50, longest=60_000) for i in range(400)]
    kinds = {p.kind for p in plans}
    assert {"generate", "stream_left", "stream_full", "embed", "completions", "malformed", "long_generate",
            "long_embed"} <= kinds
    longs = [p for p in plans if p.kind.startswith("long_")]
    assert len(longs) == 8
    for p in longs:
        text = p.body["inputs"] if p.kind == "long_generate" else p.body["inputs"][0]
        assert LONG_BYTES[0] <= len(text.encode()) <= 60_000
    for p in plans:
        if p.kind == "generate":
            assert SHORT_BYTES[0] <= len(p.body["inputs"].encode()) <= SHORT_BYTES[1]
        if p.kind == "malformed":
            assert p.allowed == frozenset({400, 422})
            assert isinstance(p.body, bytes) or json.dumps(p.body)
    with pytest.raises(SystemExit):
        Prompts([tmp_path / "missing"])
