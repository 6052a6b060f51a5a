"""`reformer loadtest`: drive a running server's /generate, /generate_stream and /embed with long documents
at several concurrency levels (closed loop) or request rates (open loop), report throughput, latency
quantiles, time to first token, inter-token latency and errors, and check the server's /metrics counters
against what the client sent. With --questions-per-doc K, each document is asked K different questions,
declaring the document as the cached part (cache_prefix_chars), and the report adds the prefix cache's hit
rate, TTFT of first and later questions and the prefill tokens saved. It only ever talks to the --url it is
given."""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.client import (
    SENDERS,
    Bound,
    GenerationSettings,
    RequestRecord,
    Send,
    Sender,
    closed_loop,
    make_client,
    open_loop,
)
from loadtest.documents import Document, DocumentError, cut_documents
from loadtest.metrics import (
    MetricsCheck,
    MetricsSnapshot,
    mean_batch_sizes,
    prefix_cache_delta,
    scrape,
    settled_check,
)
from loadtest.questions import Tagger, ask_documents, conversation, documents_bound, summarise_questions
from loadtest.report import (
    LevelResult,
    LoadTestReport,
    add_gains,
    markdown,
    plot,
    print_report,
    summarise,
)

ENDPOINT_SETS = {
    "generate": ["generate"],
    "stream": ["stream"],
    "embed": ["embed"],
    "both": ["generate", "embed"],
    "all": ["generate", "stream", "embed"],
}
OPEN_LOOP_CONNECTIONS = 256  # an open loop keeps sending; this caps sockets, not the offered rate


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected requests per second, got {text!r}") from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive rates, got {text!r}")
    return values


def _url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"expected an http(s) URL such as http://127.0.0.1:8000, got {text!r}")
    return text.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reformer loadtest", description=__doc__)
    parser.add_argument("--url", type=_url, required=True, help="the server under test (the only host contacted)")
    parser.add_argument("--docs", type=Path, required=True, help="directory of text files (books) to cut from")
    parser.add_argument(
        "--lengths",
        type=_int_list,
        default=[4096, 16384, 65536],
        help="document lengths in UTF-8 bytes (default 4096,16384,65536)",
    )
    parser.add_argument(
        "--concurrency",
        type=_int_list,
        default=[1, 4, 16],
        help="closed loop: concurrent clients per level (default 1,4,16)",
    )
    parser.add_argument(
        "--rate",
        type=_rate_list,
        default=None,
        help="open loop instead: requests/s offered per level (e.g. 2 or 1,2,4)",
    )
    bound = parser.add_mutually_exclusive_group()
    bound.add_argument("--requests", type=int, default=None, help="requests per level (default 16)")
    bound.add_argument("--duration", type=float, default=None, help="seconds per level instead of a count")
    parser.add_argument(
        "--endpoint",
        choices=sorted(ENDPOINT_SETS),
        default=None,
        help="generate, stream (/generate_stream), embed, both (generate+embed), all (default; with "
        "--questions-per-doc the default is stream, and only generate and stream are allowed)",
    )
    parser.add_argument(
        "--questions-per-doc",
        type=int,
        default=None,
        metavar="K",
        help="ask each document K different questions, one after the other, each request declaring the "
        "document as its cached part (cache_prefix_chars = the length in characters of a tag of the document's "
        "own and the document: the tag makes each use's first question new to the server). --requests then "
        "counts requests rounded up to whole documents (--duration: a document begun in time gets all K); "
        "closed loop only. Reports the server's prefix-cache hit rate over each level (hit tokens / looked-up "
        "tokens, from /metrics), TTFT (streams) and latency of first and of later questions, and the prefill "
        "tokens saved (the sum of the responses' cached_tokens)",
    )
    parser.add_argument(
        "--questions-at-once",
        action="store_true",
        help="with --questions-per-doc: send a document's K questions at the same time (the next document once "
        "all are answered) instead of one after the other; the first question is still reported apart",
    )
    parser.add_argument(
        "--no-cache-prefix",
        action="store_true",
        help="with --questions-per-doc: send the same prompts without cache_prefix_chars (the A/B against the "
        "same server; only an identical whole prompt could then hit)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens per generation (default 16)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unmeasured requests per endpoint and length before measuring (default 1; with "
        "--questions-per-doc, documents each asked two questions)",
    )
    parser.add_argument("--docs-per-length", type=int, default=16, help="distinct documents per length")
    parser.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, seconds")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--out", type=Path, default=None, help="write the full report as JSON")
    parser.add_argument("--markdown", type=Path, default=None, help="write a markdown summary")
    parser.add_argument("--plot", type=Path, default=None, help="directory for PNG charts")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when the /metrics cross-check fails or cannot be made"
    )
    return parser


def _documents_summary(docs_dir: Path, documents: dict[int, list[Document]]) -> dict[str, Any]:
    return {
        "dir": str(docs_dir),
        "by_length": {
            str(length): {
                "count": len(docs),
                "min_bytes": min(d.nbytes for d in docs),
                "max_bytes": max(d.nbytes for d in docs),
                "sources": sorted({d.source for d in docs}),
            }
            for length, docs in documents.items()
        },
    }


async def _server_info(client: httpx.AsyncClient) -> dict[str, Any] | None:
    try:
        response = await client.get("/info")
        info = response.json() if response.status_code == 200 else None
        return info if isinstance(info, dict) else None
    except (httpx.HTTPError, ValueError):
        return None


def _endpoints(args: argparse.Namespace) -> list[str]:
    if args.endpoint is None:
        return ["stream"] if args.questions_per_doc else ENDPOINT_SETS["all"]
    return ENDPOINT_SETS[args.endpoint]


def _level_requests(bound: Bound, k: int | None) -> int | None:
    """The requests a level sends, when known in advance (with questions: whole documents of K)."""
    documents = documents_bound(bound, k).requests if k else None
    return bound.requests if documents is None or k is None else documents * k


def _bind(sender: Sender, client: httpx.AsyncClient, gen: GenerationSettings) -> Send:
    def send(doc: Document) -> Awaitable[RequestRecord]:
        return sender(client, doc, gen)

    return send


async def _try_scrape(client: httpx.AsyncClient) -> MetricsSnapshot | None:
    try:
        return await scrape(client)
    except (httpx.HTTPError, ValueError):
        return None


async def run(args: argparse.Namespace, documents: dict[int, list[Document]], console: Console) -> LoadTestReport:
    endpoints = _endpoints(args)
    bound = Bound(requests=args.requests, duration_s=args.duration)
    if bound.requests is None and bound.duration_s is None:
        bound = Bound(requests=16)
    k: int | None = args.questions_per_doc
    declare = not args.no_cache_prefix
    tagger = Tagger()
    levels: list[tuple[int | None, float | None]] = (
        [(None, rate) for rate in args.rate] if args.rate else [(c, None) for c in args.concurrency]
    )
    connections = OPEN_LOOP_CONNECTIONS if args.rate else max(args.concurrency)
    gen = GenerationSettings(max_new_tokens=args.max_new_tokens)
    all_records: list[RequestRecord] = []
    results: list[LevelResult] = []
    async with make_client(args.url, args.api_key, args.timeout, connections) as client:
        info = await _server_info(client)
        before: MetricsSnapshot | None
        try:
            before = await scrape(client)
        except (httpx.HTTPError, ValueError) as exc:
            console.print(f"[bold red]cannot scrape {args.url}/metrics before the run: {exc!r}[/]")
            before = None
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            for endpoint in endpoints:
                send = _bind(SENDERS[endpoint], client, gen)
                for length in args.lengths:
                    docs = documents[length]
                    for doc in docs[: args.warmup]:
                        # with questions: a first and a later question, so both ways of reading are warm
                        for prompt in conversation(doc, tagger.next(), 2, declare) if k else [doc]:
                            all_records.append(await send(prompt))
                    for concurrency, rate in levels:
                        label = f"{endpoint:<8} {length:>6} B " + (
                            f"c={concurrency}" if rate is None else f"{rate:g}/s"
                        )
                        task = progress.add_task(label, total=_level_requests(bound, k))
                        done = functools.partial(lambda task, _record: progress.advance(task), task)
                        level_before = await _try_scrape(client)
                        if k:
                            assert concurrency is not None
                            records, wall = await ask_documents(
                                send, docs, k, concurrency, documents_bound(bound, k), done,
                                declare=declare, tagger=tagger, at_once=args.questions_at_once,
                            )  # fmt: skip
                        elif rate is None:
                            assert concurrency is not None
                            records, wall = await closed_loop(send, docs, concurrency, bound, done)
                        else:
                            records, wall = await open_loop(send, docs, rate, bound, done)
                        all_records.extend(records)
                        result = summarise(endpoint, length, concurrency, rate, records, wall)
                        level_after = await _try_scrape(client)
                        delta = None
                        if level_before and level_after:
                            result.server_batch_size = mean_batch_sizes(level_before, level_after)
                            delta = prefix_cache_delta(level_before, level_after)
                        if k:
                            result.questions = summarise_questions(records, k, declare, delta,
                                                                   at_once=args.questions_at_once)
                        results.append(result)
        if before is None:
            check = MetricsCheck(available=False, ok=False, problems=["/metrics could not be scraped before"])
        else:
            check = await settled_check(client, before, all_records)
    gains = add_gains(results)
    settings = {
        "endpoints": endpoints,
        "lengths": args.lengths,
        "concurrency": None if args.rate else args.concurrency,
        "rate": args.rate,
        "requests": bound.requests,
        "duration_s": bound.duration_s,
        "max_new_tokens": args.max_new_tokens,
        "warmup": args.warmup,
        "questions_per_doc": k,
        "questions_at_once": args.questions_at_once if k else None,
        "cache_prefix": declare if k else None,
        "run_id": tagger.run_id if k else None,
    }
    return LoadTestReport(
        url=args.url,
        settings=settings,
        server_info=info,
        documents=_documents_summary(args.docs, documents),
        results=results,
        batching_gain=gains,
        metrics_check=check,
    )


async def _reachable(url: str, api_key: str | None) -> str | None:
    async with make_client(url, api_key, 10.0, 1) as client:
        try:
            await client.get("/health")
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
    return None


def _questions_problem(args: argparse.Namespace) -> str | None:
    """Why the --questions-per-doc options cannot run as given, or None."""
    if args.questions_per_doc is None:
        if args.no_cache_prefix:
            return "--no-cache-prefix needs --questions-per-doc"
        return "--questions-at-once needs --questions-per-doc" if args.questions_at_once else None
    if args.rate:
        return "--questions-per-doc runs closed loop only (--concurrency), not --rate"
    if "embed" in _endpoints(args):
        return "--questions-per-doc drives /generate and /generate_stream: use --endpoint generate or stream"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    out = Console()
    if not out.is_terminal:
        out = Console(width=200)  # a file or pipe: keep the table's columns whole
    # option -> smallest value allowed, and option -> value it must exceed
    minimums = {"requests": 1, "max_new_tokens": 1, "docs_per_length": 1, "warmup": 0, "questions_per_doc": 1}
    floors = {"duration": 0.0, "timeout": 0.0}
    for name, least in minimums.items():
        if getattr(args, name) is not None and getattr(args, name) < least:
            console.print(f"[bold red]--{name.replace('_', '-')} must be at least {least}[/]")
            return 2
    for name, floor in floors.items():
        if getattr(args, name) is not None and getattr(args, name) <= floor:
            console.print(f"[bold red]--{name} must be more than {floor:g}[/]")
            return 2
    problem = _questions_problem(args)
    if problem:
        console.print(f"[bold red]{problem}[/]")
        return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # refused before the run, not after it: matplotlib is no dependency of the installed package
        console.print("[bold red]--plot needs matplotlib, which is not installed here (pip install matplotlib)[/]")
        return 2
    try:
        documents = cut_documents(args.docs, args.lengths, per_length=args.docs_per_length)
    except DocumentError as exc:
        console.print(f"[bold red]{exc}[/]")
        return 2
    problem = asyncio.run(_reachable(args.url, args.api_key))
    if problem:
        console.print(f"[bold red]cannot reach {args.url}: {problem}[/]")
        return 1
    report = asyncio.run(run(args, documents, console))
    print_report(report, out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report.model_dump_json(indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(report))
    if args.plot:
        for path in plot(report, args.plot):
            console.print(f"wrote {path}", soft_wrap=True, markup=False, highlight=False)
    if not report.metrics_check.ok:
        console.print("[bold red]the server's /metrics do not match what the client sent (see above)[/]")
        if args.strict:
            return 1
    if report.results and not any(r.ok for r in report.results):
        console.print("[bold red]no request was answered successfully[/]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
