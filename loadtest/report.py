"""Turn the load test's request records into results (per endpoint x length x level), and write them out:
a rich table on the terminal, a markdown summary, JSON, and PNG charts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from loadtest.client import TRANSPORT_ERROR, RequestRecord
from loadtest.metrics import MetricsCheck
from loadtest.quantiles import Quantiles
from loadtest.questions import QuestionsResult

GAIN_LEVEL = 8  # the batching gain: throughput at concurrency 8 over concurrency 1


class LevelResult(BaseModel):
    endpoint: str
    length_bytes: int  # the requested length; documents are 90-100% of it
    concurrency: int | None  # closed loop
    rate: float | None  # open loop, requests/s offered
    requests: int
    ok: int
    errors: dict[str, int]  # HTTP status (or "no_response", "stream:<error_type>") -> count
    error_types: dict[str, int] = {}  # "<status> <error_type>" -> count, for the why
    duration_s: float
    requests_per_s: float  # answered without error, per second of wall time
    tokens_per_s: float | None  # generated tokens (generate, stream); input tokens (embed)
    mean_prompt_bytes: float
    prompt_tokens: int | None  # summed over answered requests, when the server reported them
    generated_tokens: int
    latency_s: Quantiles | None
    ttft_s: Quantiles | None = None
    itl_s: Quantiles | None = None
    gain_vs_c1: float | None = None  # throughput over the same endpoint and length at concurrency 1
    server_batch_size: dict[str, float] | None = None  # mean requests per batch, by kind, from /metrics
    questions: QuestionsResult | None = None  # --questions-per-doc: first against later questions

    @property
    def level(self) -> float:
        return float(self.concurrency if self.concurrency is not None else self.rate or 0.0)


class BatchingGain(BaseModel):
    endpoint: str
    length_bytes: int
    measure: str
    at_1: float
    at_8: float
    gain: float


class LoadTestReport(BaseModel):
    url: str
    settings: dict[str, Any]
    server_info: dict[str, Any] | None
    documents: dict[str, Any]
    results: list[LevelResult]
    batching_gain: list[BatchingGain]
    metrics_check: MetricsCheck


def _error_key(record: RequestRecord) -> str:
    if record.status == TRANSPORT_ERROR:
        return "no_response"
    if record.status == 200:  # an error event inside a 200 stream, or a malformed answer
        return f"stream:{record.error}"
    return str(record.status)


def summarise(
    endpoint: str,
    length: int,
    concurrency: int | None,
    rate: float | None,
    records: list[RequestRecord],
    duration_s: float,
) -> LevelResult:
    answered = [r for r in records if r.ok]
    errors = Counter(_error_key(r) for r in records if not r.ok)
    prompt_counts = [r.prompt_tokens for r in answered if r.prompt_tokens is not None]
    prompt_tokens = sum(prompt_counts) if answered and len(prompt_counts) == len(answered) else None
    generated = sum(r.generated_tokens for r in answered)
    if endpoint == "embed":
        tokens_per_s = prompt_tokens / duration_s if prompt_tokens is not None and duration_s > 0 else None
    else:
        tokens_per_s = generated / duration_s if duration_s > 0 else None
    return LevelResult(
        endpoint=endpoint,
        length_bytes=length,
        concurrency=concurrency,
        rate=rate,
        requests=len(records),
        ok=len(answered),
        errors=dict(sorted(errors.items())),
        error_types=dict(sorted(Counter(f"{r.status} {r.error}" for r in records if not r.ok).items())),
        duration_s=duration_s,
        requests_per_s=len(answered) / duration_s if duration_s > 0 else 0.0,
        tokens_per_s=tokens_per_s,
        mean_prompt_bytes=float(np.mean([r.prompt_bytes for r in records])) if records else 0.0,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        latency_s=Quantiles.of([r.latency_s for r in answered]),
        ttft_s=Quantiles.of([r.ttft_s for r in answered if r.ttft_s is not None]),
        itl_s=Quantiles.of([gap for r in answered for gap in r.itl_s]),
    )


def _throughputs(result: LevelResult, ref: LevelResult) -> tuple[str, float, float]:
    """The same measure for both levels: tokens/s where both have it, else requests/s."""
    if result.tokens_per_s is not None and ref.tokens_per_s is not None:
        return "tokens_per_s", result.tokens_per_s, ref.tokens_per_s
    return "requests_per_s", result.requests_per_s, ref.requests_per_s


def add_gains(results: list[LevelResult]) -> list[BatchingGain]:
    """Fill gain_vs_c1 on closed-loop rows and return the issue's concurrency-8-over-1 gains."""
    gains: list[BatchingGain] = []
    base = {(r.endpoint, r.length_bytes): r for r in results if r.concurrency == 1}
    for result in results:
        ref = base.get((result.endpoint, result.length_bytes))
        if ref is None or result.concurrency is None:
            continue
        measure, value, ref_value = _throughputs(result, ref)
        if ref_value <= 0:
            continue
        result.gain_vs_c1 = value / ref_value
        if result.concurrency == GAIN_LEVEL:
            gains.append(
                BatchingGain(
                    endpoint=result.endpoint,
                    length_bytes=result.length_bytes,
                    measure=measure,
                    at_1=ref_value,
                    at_8=value,
                    gain=value / ref_value,
                )
            )
    return gains


def _ms(q: Quantiles | None, which: str) -> str:
    return "-" if q is None else f"{getattr(q, which) * 1000:.0f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _batch(r: LevelResult) -> str:
    # the batches that say whether concurrency turned into batching: embed, or decode steps
    kind = "embed" if r.endpoint == "embed" else "decode"
    return _num((r.server_batch_size or {}).get(kind), 1)


HEADER = [
    "endpoint",
    "bytes",
    "level",
    "req",
    "ok",
    "errors",
    "req/s",
    "tok/s",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "TTFT p50 ms",
    "ITL p50 ms",
    "batch",
    "x c=1",
]


def result_cells(r: LevelResult) -> list[str]:
    level = f"c={r.concurrency}" if r.concurrency is not None else f"{r.rate:g}/s"
    errors = ", ".join(f"{k}: {v}" for k, v in r.errors.items()) or "0"
    return [
        r.endpoint,
        str(r.length_bytes),
        level,
        str(r.requests),
        str(r.ok),
        errors,
        _num(r.requests_per_s),
        _num(r.tokens_per_s, 1),
        _ms(r.latency_s, "p50"),
        _ms(r.latency_s, "p95"),
        _ms(r.latency_s, "p99"),
        _ms(r.ttft_s, "p50"),
        _ms(r.itl_s, "p50"),
        _batch(r),
        _num(r.gain_vs_c1),
    ]


QUESTIONS_HEADER = [
    "endpoint",
    "bytes",
    "level",
    "docs x K",
    "declared",
    "hit rate",
    "saved tokens",
    "saved %",
    "TTFT first ms",
    "TTFT later ms",
    "first/later",
    "TTFT all ms",
    "latency first ms",
    "latency later ms",
]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def questions_cells(r: LevelResult) -> list[str]:
    """One row of the prefix-reuse table: means (TTFT, latency) in ms, the server's hit rate in %."""
    q = r.questions
    assert q is not None
    return [
        r.endpoint,
        str(r.length_bytes),
        f"c={r.concurrency}",
        f"{q.documents} x {q.questions_per_doc}" + (" at once" if q.at_once else ""),
        "yes" if q.cache_prefix_declared else "no",
        _pct(q.hit_rate),
        str(q.saved_prefill_tokens),
        _pct(q.saved_fraction),
        _ms(q.first.ttft_s, "mean"),
        _ms(q.later.ttft_s, "mean"),
        _num(q.ttft_first_over_later),
        _ms(q.all.ttft_s, "mean"),
        _ms(q.first.latency_s, "mean"),
        _ms(q.later.latency_s, "mean"),
    ]


def check_lines(check: MetricsCheck) -> list[str]:
    if not check.available:
        return ["metrics cross-check: UNAVAILABLE", *check.problems]
    lines = [f"metrics cross-check: {'OK' if check.ok else 'MISMATCH'}"]
    for item in check.checks + check.informative:
        lines.append(
            f"  {item.what}: client {item.client:g}, server "
            f"{'absent' if item.server is None else f'{item.server:g}'}"
            f"{'' if item.ok else '  <-- differs'}"
        )
    lines.extend(f"  ! {problem}" for problem in check.problems if not problem.startswith("MISMATCH"))
    return lines


def gain_lines(gains: list[BatchingGain]) -> list[str]:
    return [
        f"batching gain {g.endpoint} {g.length_bytes} B: {g.measure} {g.at_8:.1f} at c=8 vs "
        f"{g.at_1:.1f} at c=1 = x{g.gain:.2f}"
        for g in gains
    ]


def print_report(report: LoadTestReport, console: Console) -> None:
    table = Table(title=f"reformer loadtest {report.url}")
    for name in HEADER:
        table.add_column(name, justify="left" if name in ("endpoint", "errors") else "right")
    for result in report.results:
        table.add_row(*result_cells(result))
    console.print(table)
    reuse = [r for r in report.results if r.questions is not None]
    if reuse:
        table = Table(title="questions per document: prefix reuse (means)")
        for name in QUESTIONS_HEADER:
            table.add_column(name, justify="left" if name in ("endpoint", "declared") else "right")
        for result in reuse:
            table.add_row(*questions_cells(result))
        console.print(table)
    for line in gain_lines(report.batching_gain):
        console.print(line)
    style = "bold green" if report.metrics_check.ok else "bold red"
    for i, line in enumerate(check_lines(report.metrics_check)):
        console.print(line, style=style if i == 0 else None, markup=False, highlight=False)


def markdown(report: LoadTestReport) -> str:
    settings = report.settings
    lines = [
        f"Load test of `{report.url}`: endpoints {', '.join(settings['endpoints'])}, "
        f"max_new_tokens {settings['max_new_tokens']}, "
        + (
            f"{settings['requests']} requests per level."
            if settings.get("requests")
            else f"{settings['duration_s']} s per level."
        ),
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" if h in ("endpoint", "errors", "level") else "---:" for h in HEADER) + "|",
    ]
    lines.extend("| " + " | ".join(result_cells(r)) + " |" for r in report.results)
    lines.append("")
    reuse = [r for r in report.results if r.questions is not None]
    if reuse:
        lines.append("| " + " | ".join(QUESTIONS_HEADER) + " |")
        lines.append("|" + "|".join("---" if h in ("endpoint", "declared") else "---:" for h in QUESTIONS_HEADER) + "|")
        lines.extend("| " + " | ".join(questions_cells(r)) + " |" for r in reuse)
        lines.append("")
    lines.extend(f"- {line}" for line in gain_lines(report.batching_gain))
    lines.append("")
    lines.append("```")
    lines.extend(check_lines(report.metrics_check))
    lines.append("```")
    return "\n".join(lines) + "\n"


def plot(report: LoadTestReport, out_dir: Path) -> list[Path]:
    """One PNG per endpoint: latency quantiles and throughput against concurrency (or offered rate)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for endpoint in sorted({r.endpoint for r in report.results}):
        rows = [r for r in report.results if r.endpoint == endpoint and r.latency_s is not None]
        if not rows:
            continue
        open_loop = rows[0].concurrency is None
        fig, (ax_lat, ax_tp) = plt.subplots(1, 2, figsize=(11, 4.2))
        colours = matplotlib.colormaps["tab10"]
        for i, length in enumerate(sorted({r.length_bytes for r in rows})):
            series = sorted((r for r in rows if r.length_bytes == length), key=lambda r: r.level)
            x = [r.level for r in series]
            for which, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
                latency = [getattr(r.latency_s, which) for r in series]
                ax_lat.plot(x, latency, style, color=colours(i), marker="o", label=f"{length} B {which}")
            measure = [r.tokens_per_s if r.tokens_per_s is not None else r.requests_per_s for r in series]
            ax_tp.plot(x, measure, color=colours(i), marker="o", label=f"{length} B")
        levels = sorted({r.level for r in rows})
        xlabel = "offered rate (requests/s)" if open_loop else "concurrency"
        ax_lat.set(xlabel=xlabel, ylabel="latency (s)", title=f"{endpoint}: latency")
        unit = "input tokens/s" if endpoint == "embed" else "generated tokens/s"
        ax_tp.set(xlabel=xlabel, ylabel=unit, title=f"{endpoint}: throughput")
        for ax in (ax_lat, ax_tp):
            ax.set_ylim(bottom=0)  # ratios between levels read true only from zero
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            if not open_loop:
                ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [f"{level:g}" for level in levels])
        fig.tight_layout()
        path = out_dir / f"loadtest_{endpoint}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
