"""Memory series in /metrics (service/observability/memory_metrics.py), /info's memory section, and the settings
behind them."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from service import memory
from service.observability import memory_metrics
from service.observability.metrics import ServiceMetrics, exported_metric_families
from service.settings import Settings, settings_from_argv
from tests.service.helpers import metric_value, running_app

GLIBC = memory._LIBC.mallinfo2 is not None and memory._LIBC.trim is not None


def test_memory_families_are_exported() -> None:
    families = exported_metric_families()
    assert {"reformer_heap_trims_total", "reformer_heap_trim_seconds_total", "reformer_heap_last_trim_released_bytes",
            "reformer_memory_budget_bytes", "process_resident_memory_bytes"} <= families
    if GLIBC:
        assert {"reformer_heap_mapped_bytes", "reformer_heap_in_use_bytes",
                "reformer_heap_free_retained_bytes"} <= families
    # the debug view costs a walk over every object: only when asked for
    assert "reformer_python_objects" not in families and "reformer_live_tensor_bytes" not in families


def test_trim_counters_start_at_zero_before_the_engine_exists() -> None:
    text = ServiceMetrics().render().decode()
    assert 'reformer_heap_trims_total{reason="idle"} 0.0' in text
    assert 'reformer_heap_trims_total{reason="budget"} 0.0' in text
    assert "reformer_memory_budget_bytes 0.0" in text
    assert 'reformer_decode_cache_released_bytes_total{reason="finished"} 0.0' in text


@pytest.mark.skipif(not GLIBC, reason="glibc's mallinfo2 and malloc_trim only")
def test_the_served_app_reports_its_heap_its_trims_and_its_budget(artifact: Any) -> None:
    with running_app(artifact, idle_trim_s=0.1, memory_budget_mb=4096) as client:
        assert client.post("/generate", json={"inputs": "abc", "parameters": {"max_new_tokens": 4}}).status_code == 200
        deadline = time.monotonic() + 20
        while metric_value(text := client.get("/metrics").text, "reformer_heap_trims_total", {"reason": "idle"}) < 1:
            assert time.monotonic() < deadline, "no idle trim"
            time.sleep(0.05)
        info = client.get("/info").json()
    mapped, in_use = metric_value(text, "reformer_heap_mapped_bytes"), metric_value(text, "reformer_heap_in_use_bytes")
    assert 0 < in_use <= mapped and metric_value(text, "reformer_heap_free_retained_bytes") >= 0
    assert 0 < in_use < 2**40 and metric_value(text, "process_resident_memory_bytes") > 0
    assert metric_value(text, "reformer_heap_trim_seconds_total") > 0
    assert metric_value(text, "reformer_heap_last_trim_released_bytes") >= 0
    assert metric_value(text, "reformer_memory_budget_bytes") == 4096 * 2**20
    assert info["memory"] == {"idle_trim_s": 0.1, "busy_trim_s": 30.0, "memory_budget_bytes": 4096 * 2**20,
                              "malloc_trim_available": True, "decode_cache_release": True,
                              "decode_cache_keep_bytes": 64 * 2**20, "decode_cache_keeps_prefix_hits": True,
                              "heap_stats_available": True}
    assert metric_value(text, "reformer_decode_cache_resident_bytes") > 0  # block 0 of each pool, at least
    assert metric_value(text, "reformer_decode_cache_written_free_bytes") >= 0
    assert metric_value(text, "reformer_decode_cache_released_bytes_total", {"reason": "idle"}) >= 0
    assert info["settings"]["idle_trim_s"] == 0.1 and info["settings"]["memory_budget_mb"] == 4096


def test_the_debug_view_counts_objects_and_live_tensor_bytes(artifact: Any) -> None:
    weights = sum(p.numel() * p.element_size() for p in artifact.model.parameters())
    with running_app(artifact, debug_memory=True) as client:
        text = client.get("/metrics").text
    assert metric_value(text, "reformer_python_objects") > 1000
    assert metric_value(text, "reformer_live_tensor_bytes") >= weights  # at least the model's weights
    if memory_metrics.mappings() is not None:  # the weights are written, so resident (pro rata in the heap)
        assert metric_value(text, "reformer_live_tensor_resident_bytes") > 0


def test_the_debug_view_is_computed_at_most_every_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def figures() -> tuple[int, int, int | None]:
        calls.append(1)
        return len(calls), 10, 5

    monkeypatch.setattr(memory_metrics, "debug_figures", figures)
    metrics = ServiceMetrics(debug_memory=True)
    first, second = metrics.render().decode(), metrics.render().decode()
    assert len(calls) == 1 and "reformer_python_objects 1.0" in first and "reformer_python_objects 1.0" in second
    assert "reformer_live_tensor_resident_bytes 5.0" in second


def test_resident_bytes_are_shared_out_by_mapping() -> None:
    # two storages: one is a whole mapping (a pool), one a quarter of a shared mapping (the heap)
    storages = {0x10000: 0x10000, 0x40000: 0x4000}
    maps = [(0x10000, 0x20000, 0x3000), (0x40000, 0x50000, 0x8000), (0x90000, 0xA0000, 0x10000)]
    assert memory_metrics.attributed_resident(storages, maps) == 0x3000 + 0x8000 // 4
    assert memory_metrics.attributed_resident({}, maps) == 0


@pytest.mark.skipif(memory_metrics.mappings() is None, reason="/proc/self/smaps only")
def test_resident_bytes_count_written_pages_not_read_ones() -> None:
    import mmap

    size = 64 * 2**20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # as model/decoding/huge_pages.py maps a pool; the flag keeps it its own mapping
        region.madvise(mmap.MADV_HUGEPAGE)
    pool = torch.frombuffer(region, dtype=torch.uint8)
    storages = {pool.data_ptr(): size}

    def resident() -> int:
        maps = memory_metrics.mappings()
        assert maps is not None
        return memory_metrics.attributed_resident(storages, maps)

    assert int(pool.sum()) == 0  # read only: the zero page, which RSS does not count (mincore would)
    assert resident() < 2**20
    pool[: size // 2] = 1
    assert size // 2 <= resident() <= size // 2 + 4 * 2**20  # up to a huge page either side
    del pool


def test_a_failing_heap_read_leaves_the_scrape_whole(artifact: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise OSError("mallinfo2 exploded")

    monkeypatch.setattr(memory_metrics, "heap_stats", broken)
    with running_app(artifact) as client:
        r = client.get("/metrics")
    assert r.status_code == 200 and "reformer_queue_size" in r.text and "process_resident_memory_bytes" in r.text
    assert "reformer_heap_in_use_bytes" not in r.text


def test_memory_settings_validate_with_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    s = settings_from_argv(["--idle-trim-s", "0", "--memory-budget-mb", "2048", "--debug-memory"])
    assert s.idle_trim_s == 0 and s.memory_budget_mb == 2048 and s.debug_memory is True
    assert Settings().idle_trim_s == 2.0 and Settings().memory_budget_mb == 0 and Settings().debug_memory is False
    for bad in ({"idle_trim_s": -1}, {"idle_trim_s": float("inf")}, {"idle_trim_s": float("nan")},
                {"idle_trim_s": 10**6}, {"memory_budget_mb": -5}, {"memory_budget_mb": 1.5}):
        with pytest.raises(ValidationError) as caught:
            Settings(**bad)  # type: ignore[arg-type]
        assert next(iter(bad)) in str(caught.value)  # the error names the setting
    monkeypatch.setenv("REFORMER_IDLE_TRIM_S", "soon")
    with pytest.raises(ValidationError, match="idle_trim_s"):
        Settings()
