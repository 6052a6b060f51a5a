"""Scrape the server's Prometheus `/metrics` before and after a load test and check that the server counted
what the client sent: `reformer_requests_total{route,status}` per driven route and status, and
`reformer_generated_tokens_total` against the tokens the client received."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from loadtest.client import ROUTES, TRANSPORT_ERROR, RequestRecord

REQUESTS = "reformer_requests_total"
GENERATED_TOKENS = "reformer_generated_tokens_total"
PROMPT_TOKENS = "reformer_prompt_tokens_total"
BATCH_SIZE = "reformer_batch_size"  # histogram by kind: embed, prefill, decode
PREFIX_QUERIES = "reformer_prefix_cache_queries_tokens_total"  # tokens of the segments looked up
PREFIX_HITS = "reformer_prefix_cache_hits_tokens_total"  # tokens restored, by tier (memory, disk)


@dataclass
class MetricsSnapshot:
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)  # (route, status) -> count
    generated_tokens: float = 0.0
    prompt_tokens: float = 0.0
    present: set[str] = field(default_factory=set)  # which of the series read here the server exposes
    batch_sum: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # kind -> requests
    batch_count: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # kind -> batches
    prefix_queries_tokens: float = 0.0
    prefix_hits_tokens: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # by tier


@dataclass(frozen=True)
class PrefixCacheDelta:
    """What the server's prefix cache counted between two scrapes, in tokens."""

    queries_tokens: float
    hits_tokens: dict[str, float]  # by tier

    @property
    def hit_rate(self) -> float | None:
        return sum(self.hits_tokens.values()) / self.queries_tokens if self.queries_tokens > 0 else None


def prefix_cache_delta(before: MetricsSnapshot, after: MetricsSnapshot) -> PrefixCacheDelta | None:
    """None when the server exposes no prefix-cache counters."""
    if PREFIX_QUERIES not in after.present:
        return None
    tiers = set(before.prefix_hits_tokens) | set(after.prefix_hits_tokens)
    return PrefixCacheDelta(
        queries_tokens=after.prefix_queries_tokens - before.prefix_queries_tokens,
        hits_tokens={t: after.prefix_hits_tokens[t] - before.prefix_hits_tokens[t] for t in sorted(tiers)},
    )


def mean_batch_sizes(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, float]:
    """Requests per batch the server ran between two scrapes, by kind (embed, prefill, decode)."""
    sizes = {}
    for kind, count in after.batch_count.items():
        batches = count - before.batch_count[kind]
        if batches > 0:
            sizes[kind] = (after.batch_sum[kind] - before.batch_sum[kind]) / batches
    return sizes


def _route(label: str) -> str:
    return label if label.startswith("/") else "/" + label


def parse_metrics(text: str) -> MetricsSnapshot:
    snap = MetricsSnapshot()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == REQUESTS:
                key = (_route(sample.labels.get("route", "")), sample.labels.get("status", ""))
                snap.requests[key] += int(sample.value)
            elif sample.name == GENERATED_TOKENS:
                snap.generated_tokens += sample.value
            elif sample.name == PROMPT_TOKENS:
                snap.prompt_tokens += sample.value
            elif sample.name == BATCH_SIZE + "_sum":
                snap.batch_sum[sample.labels.get("kind", "")] += sample.value
            elif sample.name == BATCH_SIZE + "_count":
                snap.batch_count[sample.labels.get("kind", "")] += sample.value
            elif sample.name == PREFIX_QUERIES:
                snap.prefix_queries_tokens += sample.value
            elif sample.name == PREFIX_HITS:
                snap.prefix_hits_tokens[sample.labels.get("tier", "")] += sample.value
            else:
                continue
            snap.present.add(sample.name)
    return snap


async def scrape(client: httpx.AsyncClient) -> MetricsSnapshot:
    response = await client.get("/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


class CountCheck(BaseModel):
    what: str  # "requests /embed 200", "generated tokens", ...
    client: float
    server: float | None  # None: the server does not expose the series
    ok: bool


class MetricsCheck(BaseModel):
    available: bool  # /metrics could be scraped before and after
    ok: bool  # every strict check matched
    checks: list[CountCheck] = []
    informative: list[CountCheck] = []  # compared and shown, never fail the run
    problems: list[str] = []


def _status_label(status: int, server_labels: set[str]) -> str:
    # a server that labels by class ("2xx") is compared by class
    if server_labels and all(label.endswith("xx") for label in server_labels):
        return f"{status // 100}xx"
    return str(status)


def compare(before: MetricsSnapshot, after: MetricsSnapshot, records: list[RequestRecord]) -> MetricsCheck:
    result = MetricsCheck(available=True, ok=True)
    delta = after.requests.copy()
    delta.subtract(before.requests)
    routes = sorted({ROUTES[r.endpoint] for r in records})
    if REQUESTS not in after.present:
        result.problems.append(f"the server exposes no {REQUESTS}")
    for route in routes:
        server_labels = {status for (r, status) in delta if r == route}
        client_counts: Counter[str] = Counter()
        for record in records:
            if ROUTES[record.endpoint] == route and record.status != TRANSPORT_ERROR:
                client_counts[_status_label(record.status, server_labels)] += 1
        lost = sum(1 for r in records if ROUTES[r.endpoint] == route and r.status == TRANSPORT_ERROR)
        if lost:
            result.problems.append(f"{route}: {lost} requests got no HTTP response; the server may count them")
        for status in sorted(set(client_counts) | {s for s in server_labels if delta[(route, s)]}):
            server = delta[(route, status)] if REQUESTS in after.present else None
            client = client_counts[status]
            result.checks.append(
                CountCheck(what=f"requests {route} {status}", client=client, server=server, ok=server == client)
            )
    generation = [r for r in records if r.endpoint in ("generate", "stream")]
    if generation:
        client_tokens = float(sum(r.generated_tokens for r in generation))
        present = GENERATED_TOKENS in after.present
        server_tokens = after.generated_tokens - before.generated_tokens if present else None
        if not present:
            result.problems.append(f"the server exposes no {GENERATED_TOKENS}")
        result.checks.append(
            CountCheck(
                what="generated tokens",
                client=client_tokens,
                server=server_tokens,
                ok=server_tokens == client_tokens,
            )
        )
    known_prompts = [r.prompt_tokens for r in records if r.ok and r.prompt_tokens is not None]
    if PROMPT_TOKENS in after.present and known_prompts:
        # informative only: whether embed inputs count as prompt tokens is the server's choice
        server_prompt = after.prompt_tokens - before.prompt_tokens
        client_prompt = float(sum(known_prompts))
        result.informative.append(
            CountCheck(
                what="prompt tokens (answered requests)",
                client=client_prompt,
                server=server_prompt,
                ok=server_prompt == client_prompt,
            )
        )
    for check in result.checks:
        if not check.ok:
            result.ok = False
            result.problems.append(f"MISMATCH {check.what}: client {check.client:g}, server {check.server}")
    return result


async def settled_check(
    client: httpx.AsyncClient,
    before: MetricsSnapshot,
    records: list[RequestRecord],
    attempts: int = 10,
    pause_s: float = 0.3,
) -> MetricsCheck:
    """Compare, rescraping a few times: a server may count a request just after its last byte is sent."""
    check = MetricsCheck(available=False, ok=False)
    for attempt in range(attempts):
        try:
            after = await scrape(client)
        except (httpx.HTTPError, ValueError) as exc:
            return MetricsCheck(available=False, ok=False, problems=[f"/metrics after the run: {exc!r}"])
        check = compare(before, after, records)
        if check.ok or attempt == attempts - 1:
            break
        await asyncio.sleep(pause_s)
    return check
