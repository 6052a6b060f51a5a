"""bench/decode/step_cost.py's arithmetic: the window bytes a row reads, the distinct share of its LSH windows'
slots, and the straight-line fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import bench.decode.step_cost as step_cost
from model import ReformerLM
from model.decoding import DecodeCache, Decoder, prefill
from tests.conftest import tiny_config, tiny_model


def test_window_bytes_count_every_slot_of_every_layer() -> None:
    cfg = tiny_config()  # a local layer and an LSH layer, 2 heads of 16, chunks of 8, 2 rounds, 1 chunk before
    lsh = 2 * 2 * (2 * 8) * (2 * 16 * 4 + 4)  # heads x rounds x (2 chunks of 8) x (key + value rows + norm)
    local = 2 * (8 + 8 / 2) * (2 * 16 * 4)  # heads x (the chunk before + half of its own) x (key + value)
    assert step_cost.window_bytes_per_row(cfg, 4) == pytest.approx(lsh + local)
    assert step_cost.window_bytes_per_row(cfg, 4, 0.5) == pytest.approx(lsh / 2 + local)


def test_fit_line_recovers_a_line() -> None:
    a, b = step_cost.fit_line([1.0, 2.0, 4.0, 8.0], [3.0 + 0.5 * x for x in (1.0, 2.0, 4.0, 8.0)])
    assert (a, b) == pytest.approx((3.0, 0.5))


def _running(lm: ReformerLM, rows: int, length: int) -> tuple[Decoder, list, list[int]]:
    cache = DecodeCache.for_tokens(lm, length + 8, slots=rows)
    decoder = Decoder(lm, cache)
    states: list = []
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(rows):
            states += prefill(lm, cache, [torch.randint(3, 258, (length,), generator=gen)], [length + 8])[1]
    return decoder, states, [5] * rows


def test_one_round_windows_hold_distinct_rows_and_the_cache_is_left_as_it_was() -> None:
    # one hash round: a window is two neighbouring chunks of one sorted order, so no position twice. After 64
    # prompt tokens the new position makes the order 65 items long: 8 full chunks of 8 and a ninth holding one
    # item and 7 padding slots (which hold no row). A window is two full chunks (16 rows) or holds the ninth
    # (9 rows), so with k of the 2 rows x 2 heads holding the ninth the share is ((4 - k) * 16 + k * 9) / 64.
    lm = tiny_model(num_hashes=1)
    decoder, states, tokens = _running(lm, 2, 64)
    kernel, fused = decoder.backends.window, decoder.backends.fused
    share = step_cost.lsh_distinct_share(decoder, states, tokens)
    assert share in {((4 - k) * 16 + k * 9) / 64 for k in range(5)}
    assert decoder.backends.window is kernel and decoder.backends.fused is fused
    assert "gather_keys" not in vars(decoder.cache)
    assert all(s.length == 65 for s in states)  # the step it watched was a real step


def test_two_rounds_share_rows() -> None:
    lm = tiny_model()
    decoder, states, tokens = _running(lm, 2, 64)
    share = step_cost.lsh_distinct_share(decoder, states, tokens)
    assert share is not None and 0.5 <= share < 1.0  # each round's window alone is distinct
    with torch.inference_mode():
        decoder.step(tokens, states)  # the cache still steps after the watched one
    assert all(s.length == 66 for s in states)


def test_main_reports_the_per_row_cost_each_target_allows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # steps of 1 ms plus 0.5 ms per added row: batch 8 takes 4.5 ms (4.5x), batch 32 16.5 ms
    times = {1: [0.001], 2: [0.0015], 8: [0.0045], 32: [0.0165]}
    monkeypatch.setattr(step_cost, "read_bandwidth", lambda: 1e10)
    monkeypatch.setattr(step_cost, "load_model", lambda artifact: tiny_model())
    monkeypatch.setattr(step_cost, "time_steps", lambda *args: (times, 0.5))
    monkeypatch.setattr(step_cost, "_print", lambda result: None)
    monkeypatch.setattr(step_cost, "tune_cpu_runtime", lambda: {})  # process-wide: not in a test worker
    out = tmp_path / "cost.json"
    threads = torch.get_num_threads()
    try:
        assert step_cost.main(["--batch-sizes", "1,2,8,32", "--out", str(out), "--threads", str(threads)]) == 0
    finally:
        torch.set_num_threads(threads)
    r = json.loads(out.read_text())
    assert r["fixed_ms"] == pytest.approx(0.5) and r["per_row_ms"] == pytest.approx(0.5)
    assert r["window_bytes_per_row"] == pytest.approx(step_cost.window_bytes_per_row(tiny_config(), 4, 0.5))
    assert r["per_row_floor_ms"] == pytest.approx(1000 * r["window_bytes_per_row"] / 1e10)
    eight, many = r["targets"]["step_8_vs_1"], r["targets"]["tokens_32_vs_1"]
    assert eight["measured"] == pytest.approx(4.5) and eight["per_row_measured_ms"] == pytest.approx(0.5)
    assert eight["per_row_needed_ms"] == pytest.approx(1 / 7)  # 1 + 7 b <= 2
    assert many["measured"] == pytest.approx(32 / 16.5) and many["per_row_needed_ms"] == pytest.approx(3 / 31)
    assert out.with_suffix(".png").stat().st_size > 0
