"""The soak's summaries (bench/serving/soak.py), pure functions over what it recorded: memory samples from /metrics,
latency percentiles per window, error counts by kind, and the verdict against the issue's targets:

- 0 5xx and 0 lost requests (sent, and neither answered nor left by the client on purpose);
- RSS at the end of the run at most 5% above RSS at 1/6 of it (60 min against 10 min in the hour's run);
- p99 latency of the last window within 1.2x of the second window's (minutes 50-60 against 10-20).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

RSS_GROWTH_LIMIT = 1.05
P99_GROWTH_LIMIT = 1.2
# Outcomes of a request as the client saw it; LOST ones had no complete answer.
OK, UNEXPECTED, SERVER_ERROR = "ok", "unexpected_status", "http_5xx"
TRANSPORT, TIMEOUT, TRUNCATED = "transport_error", "timeout", "truncated_stream"
LOST = (TRANSPORT, TIMEOUT, TRUNCATED)
OUTCOMES = (OK, UNEXPECTED, SERVER_ERROR, *LOST)

# /metrics series a sample keeps: field -> (metric name, labels)
SAMPLE_SERIES: dict[str, tuple[str, dict[str, str]]] = {
    "rss_bytes": ("process_resident_memory_bytes", {}),
    "heap_mapped_bytes": ("reformer_heap_mapped_bytes", {}),
    "heap_in_use_bytes": ("reformer_heap_in_use_bytes", {}),
    "heap_free_retained_bytes": ("reformer_heap_free_retained_bytes", {}),
    "heap_trims_idle": ("reformer_heap_trims_total", {"reason": "idle"}),
    "heap_trims_busy": ("reformer_heap_trims_total", {"reason": "busy"}),
    "heap_trims_budget": ("reformer_heap_trims_total", {"reason": "budget"}),
    "heap_last_trim_released_bytes": ("reformer_heap_last_trim_released_bytes", {}),
    "heap_trim_seconds": ("reformer_heap_trim_seconds_total", {}),
    "live_tensor_bytes": ("reformer_live_tensor_bytes", {}),
    "live_tensor_resident_bytes": ("reformer_live_tensor_resident_bytes", {}),
    "python_objects": ("reformer_python_objects", {}),
    "decode_cache_allocated_bytes": ("reformer_decode_cache_bytes", {"state": "allocated"}),
    "decode_cache_resident_bytes": ("reformer_decode_cache_resident_bytes", {}),
    "decode_cache_released_finished_bytes": ("reformer_decode_cache_released_bytes_total", {"reason": "finished"}),
    "running_generations": ("reformer_running_generations", {}),
    "queued_generate": ("reformer_queue_size", {"kind": "generate"}),
    "queued_embed": ("reformer_queue_size", {"kind": "embed"}),
}


@dataclass(frozen=True)
class Record:
    """One request: its kind (the mix's name for it), when it ended (seconds into the run), how long it took
    from send to its last byte (a stream left on purpose: to its last event read), and its outcome."""

    kind: str
    end_s: float
    latency_s: float
    outcome: str


def parse_series(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text -> {(name, labels): value}. Enough for the service's own output (no escaped quotes or
    commas inside label values)."""
    series: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        pairs = (part.split("=", 1) for part in labels.rstrip("}").split(",") if "=" in part)
        try:
            series[(name, frozenset((k.strip(), v.strip().strip('"')) for k, v in pairs))] = float(value)
        except ValueError:
            continue
    return series


def memory_sample(text: str, t_s: float) -> dict[str, float | None]:
    """The fields of SAMPLE_SERIES from one scrape (None for a series the server does not export)."""
    series = parse_series(text)
    sample: dict[str, float | None] = {"t_s": round(t_s, 3)}
    for field_name, (name, labels) in SAMPLE_SERIES.items():
        sample[field_name] = series.get((name, frozenset(labels.items())))
    return sample


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) as bench/serving/overload.py takes it; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _latency_stats(latencies: list[float]) -> dict[str, float | int | None]:
    return {"count": len(latencies), "p50_s": percentile(latencies, 0.50), "p95_s": percentile(latencies, 0.95),
            "p99_s": percentile(latencies, 0.99), "max_s": max(latencies) if latencies else None}


def windows(records: list[Record], window_s: float, duration_s: float) -> list[dict[str, Any]]:
    """Per window of `window_s` (by each request's end; the last one may be shorter, and requests that end
    after the run, in flight at its close, join it): latency percentiles of the answered requests (outcome
    ok), overall and by kind, and the outcomes of all."""
    count = max(1, math.ceil(duration_s / window_s - 1e-9))
    out = []
    for k in range(count):
        start, end = k * window_s, min((k + 1) * window_s, duration_s)
        inside = [r for r in records if start <= r.end_s < end or (k == count - 1 and r.end_s >= end)]
        answered = [r for r in inside if r.outcome == OK]
        kinds = sorted({r.kind for r in answered})
        out.append({
            "start_s": start, "end_s": end,
            **_latency_stats([r.latency_s for r in answered]),
            "outcomes": dict(Counter(r.outcome for r in inside)),
            "by_kind": {kind: _latency_stats([r.latency_s for r in answered if r.kind == kind]) for kind in kinds},
        })
    return out


def error_counts(records: list[Record]) -> dict[str, int]:
    """Requests by outcome (every outcome present, 0 when none) and `lost`, the sum of the lost kinds."""
    counts = Counter(r.outcome for r in records)
    result = {outcome: counts.get(outcome, 0) for outcome in OUTCOMES}
    result["lost"] = sum(result[o] for o in LOST)
    result["requests"] = len(records)
    return result


def value_at(samples: list[dict[str, Any]], t_s: float, field_name: str) -> float | None:
    """The field in the first sample taken at or after `t_s` that has it (the last one if none is later)."""
    having = [s for s in samples if s.get(field_name) is not None]
    if not having:
        return None
    later = [s for s in having if s["t_s"] >= t_s]
    return float((later[0] if later else having[-1])[field_name])


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def verdict(samples: list[dict[str, Any]], wins: list[dict[str, Any]], errors: dict[str, int],
            duration_s: float, before: dict[str, Any] | None = None,
            after_idle: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run against the targets. RSS: the last sample of the run against the first at or after 1/6 of
    it. p99: the last window against the second (needs three windows at least, else not judged). A target
    that cannot be judged (no samples, too few windows) fails `passed`, so a broken run never passes.
    `before` (idle, before the load) and `after_idle` (idle past the idle trim, after it) add the growth
    from idle to idle, the clean view of a leak: under load the in-use bytes swing with what is in flight."""
    reference_t = duration_s / 6
    in_run = [s for s in samples if s["t_s"] <= duration_s + 1e-9]
    rss_ref = value_at(in_run, reference_t, "rss_bytes")
    rss_end = value_at(in_run, duration_s, "rss_bytes")
    rss_ratio = _ratio(rss_end, rss_ref)
    p99_ratio = _ratio(wins[-1]["p99_s"], wins[1]["p99_s"]) if len(wins) >= 3 else None
    checks = {
        "no_5xx": errors.get(SERVER_ERROR, 0) == 0,
        "no_lost_requests": errors.get("lost", 0) == 0,
        "rss_growth_within_5pct": rss_ratio is not None and rss_ratio <= RSS_GROWTH_LIMIT,
        "p99_last_within_1_2x_of_second_window": p99_ratio is not None and p99_ratio <= P99_GROWTH_LIMIT,
    }
    growth = idle_growth(before or {}, after_idle or {})
    rss_after_idle = (after_idle or {}).get("rss_bytes")
    return {
        "rss_reference_t_s": reference_t, "rss_reference_bytes": rss_ref, "rss_end_bytes": rss_end,
        "rss_ratio": rss_ratio, "rss_after_idle_bytes": rss_after_idle, "idle_to_idle_growth": growth,
        "p99_second_window_s": wins[1]["p99_s"] if len(wins) >= 2 else None, "p99_last_window_s": wins[-1]["p99_s"],
        "p99_ratio": p99_ratio, "checks": checks, "passed": all(checks.values()),
        "reading": memory_reading(rss_ratio, rss_end, rss_after_idle, growth, before or {}),
    }


IDLE_FIELDS = ("rss_bytes", "heap_mapped_bytes", "heap_in_use_bytes", "live_tensor_resident_bytes",
               "python_objects")
NOISE_BYTES = 16 * 2**20  # idle-to-idle differences under this are noise (an arena's free top, a few buffers)


def idle_growth(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float | None]:
    """after - before for each of IDLE_FIELDS (None where either lacks it)."""
    return {f: None if before.get(f) is None or after.get(f) is None else after[f] - before[f] for f in IDLE_FIELDS}


def memory_reading(rss_ratio: float | None, rss_end: float | None, rss_after_idle: float | None,
                   growth: dict[str, float | None], before: dict[str, Any]) -> str:
    """What the series say together. A leak grows what is allocated from idle to idle (heap in-use bytes,
    Python objects); retention (freed memory the heap keeps) is RSS the idle trim gives back; the decode
    cache's pools are resident once written, so a new high-water mark of the cache shows as resident tensor
    bytes that stay."""
    if rss_ratio is None:
        return "no RSS samples"
    mb = 2**20
    parts = ["RSS flat under load" if rss_ratio <= RSS_GROWTH_LIMIT
             else f"RSS grew {100 * (rss_ratio - 1):.0f}% under load"]
    if rss_end is not None and rss_after_idle is not None:
        parts.append(f"idle trim gave back {(rss_end - rss_after_idle) / mb:.0f} MB (retained, not leaked)")
    in_use = growth.get("heap_in_use_bytes")
    if in_use is None:
        parts.append("no idle-to-idle heap figures")
    elif in_use > max(NOISE_BYTES, 0.05 * float(before.get("heap_in_use_bytes") or 0)):
        parts.append(f"heap in-use grew {in_use / mb:.0f} MB idle to idle: live allocations grow (leak or cache)")
    else:
        parts.append(f"heap in-use idle to idle {in_use / mb:+.0f} MB: no leak in malloc'd memory")
    objects = growth.get("python_objects")
    if objects is not None and objects > 0.05 * float(before.get("python_objects") or 0):
        parts.append(f"Python objects grew by {objects:.0f} idle to idle")
    resident = growth.get("live_tensor_resident_bytes")
    if resident is not None and resident > NOISE_BYTES:
        parts.append(f"resident tensor pages grew {resident / mb:.0f} MB idle to idle (the decode cache's pools "
                     "stay resident once written: a new high-water mark of the cache)")
    return "; ".join(parts)
