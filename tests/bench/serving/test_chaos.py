"""The chaos run's short form (bench/serving/chaos.py has the full one): a loopback server of the tiny model
under 8 clients for 12 s that leave at random points, send n/best_of requests, bad, huge, too long and too
slow bodies, and read streams slowly. Afterwards: no 5xx and nothing lost, every answer delivered equal to the
request alone, queue and decode cache empty, CPU idle within 1 s of the last client leaving, RSS within 5%."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.server_process import ServerProcess, service_argv
from bench.serving.chaos import SERVER_SETTINGS, run, server_settings

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(120)
def test_a_short_chaos_run_loses_nothing(tiny_artifact: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **server_settings({"max_input_tokens": 1800})}
    with ServerProcess(service_argv(tiny_artifact), log_path=tmp_path / "server.log", env=env, cwd=REPO) as server:
        server.wait_ready(120, poll_s=0.1)
        report = run(server.url, server.proc.pid, seconds=12.0, clients=8, seed=54, limits=SERVER_SETTINGS)
        log = server.log_tail(3000)
    failed = [name for name, ok in report["checks"].items() if not ok]
    assert not failed, (failed, {k: report[k] for k in ("statuses", "lost", "mismatches", "after",
                                                        "cpu_idle_after_last_client_s", "rss_change")}, log)
    # the storm reached the stages it aims at
    assert report["answers_compared"] > 0
    assert report["dropped"]["queued"] + report["dropped"]["prefill"] + report["dropped"]["decode"] > 0
