"""loadtest/metrics.py: the cross-check of the server's /metrics counters against what the client sent."""

from __future__ import annotations

from loadtest.client import RequestRecord
from loadtest.metrics import compare, parse_metrics


def _metrics(embed_ok: int, generate_ok: int, tokens: int) -> str:
    return (
        "# TYPE reformer_requests_total counter\n"
        f'reformer_requests_total{{route="/embed",status="200"}} {embed_ok}\n'
        f'reformer_requests_total{{route="/generate",status="200"}} {generate_ok}\n'
        'reformer_requests_total{route="/metrics",status="200"} 7\n'
        "# TYPE reformer_generated_tokens_total counter\n"
        f"reformer_generated_tokens_total {tokens}\n"
    )


def test_cross_check_matches_and_names_each_mismatch() -> None:
    before = parse_metrics(_metrics(embed_ok=5, generate_ok=1, tokens=10))
    records = [RequestRecord("embed", 200, 0.0, 0.1)] * 2 + [
        RequestRecord("generate", 200, 0.0, 0.1, generated_tokens=4)
    ]
    assert compare(before, parse_metrics(_metrics(embed_ok=7, generate_ok=2, tokens=14)), records).ok
    wrong = compare(before, parse_metrics(_metrics(embed_ok=8, generate_ok=2, tokens=13)), records)
    assert not wrong.ok
    assert {c.what for c in wrong.checks if not c.ok} == {"requests /embed 200", "generated tokens"}
    assert any(p.startswith("MISMATCH requests /embed 200: client 2") for p in wrong.problems)
