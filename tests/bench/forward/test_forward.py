"""bench/forward/forward.py's arithmetic: the ceiling fraction is wall-clock FLOP/s over a ceiling measured with the
same thread count (the issue's case: 2 threads, 36% by wall clock, once misreported as 18%)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

import bench.forward.forward as forward


def test_ceiling_fraction_is_wall_clock_flops_over_the_ceiling() -> None:
    # 1,000 tokens per wall-clock second at 12 MFLOP each is 12 GFLOP/s; against 33.3 GFLOP/s that is 36%.
    assert forward.ceiling_fraction(1000.0, 12e6, 100 / 3) == pytest.approx(0.36)


def test_two_thread_run_reports_the_wall_clock_fraction(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    flops = forward.flops_per_token()
    ceiling = 1000.0 * flops / 0.36 / 1e9  # a two-thread ceiling at which 1,000 tokens/s is 36%
    seen_threads: list[int] = []

    def fake_ceiling(threads: int) -> float:
        seen_threads.append(threads)
        return ceiling

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        # Two threads, both busy all the time: CPU seconds are twice the wall-clock seconds.
        row = {"model": cmd[-4], "length": int(cmd[-3]), "tokens_per_s": 1000.0, "tokens_per_cpu_s": 500.0,
               "seconds": 1.0, "cpu_seconds": 2.0, "peak_rss_mb": 1.0}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(forward, "matmul_ceiling", fake_ceiling)
    monkeypatch.setattr(forward.subprocess, "run", fake_run)
    monkeypatch.setattr(forward, "print_table", lambda report: None)
    monkeypatch.setattr(forward, "plot", lambda report, path: None)
    out = tmp_path / "forward.json"
    assert forward.main(["--lengths", "4096", "--models", "ours", "--threads", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert seen_threads == [2]
    assert report["rows"][0]["ceiling_fraction"] == pytest.approx(0.36)
