"""A short soak (the full one is bench/serving/soak.py): mixed requests leave nothing behind."""

from __future__ import annotations

from typing import Any

import pytest

from bench.serving.soak import run_soak

pytestmark = pytest.mark.xdist_group("service-soak")


def test_short_soak_leaves_no_queued_work_cache_or_threads(server_factory: Any) -> None:
    server = server_factory(backend="torch", max_new_tokens=256)
    report = run_soak(server.url, requests=120, concurrency=4, warmup=40, pid=server.proc.pid)
    assert report["unexpected"] == 0 and report["warmup_unexpected"] == 0
    assert report["ok"] + report["abandoned"] == 120
    assert report["leftover_queued"] == 0
    assert report["leftover_running"] == 0
    assert report["leftover_cache_bytes"] == 0
    assert report["inflight_during_final_scrape"] == 0  # the scrape itself is not a request (issue 15)
    assert report["threads_after"] <= report["threads_after_warmup"] + 2
