"""Soak benchmark: a server under a steady mixed load, and what its memory and latency do over time.

Timed (the documented benchmark; bench/serving/README.md, "Soak"):

    python bench/serving/soak.py --minutes 60 [--clients 6] [--window-minutes 10] [--sample-s 10] [--long-every 200]
                         [--data corpus/data --data corpus/corpus] [--artifact DIR | --url URL]
                         [--idle-trim-s S] [--busy-trim-s S] [--memory-budget-mb MB] [--no-debug-memory]
                         [--out bench/results/soak_60min.json.gz]

`--clients` coroutines send the mix of bench/serving/soak_load.py back to back for `--minutes` (long prompts of
32-64 KB every `--long-every`-th request, streams left after 5 events, malformed bodies). Every `--sample-s`
seconds /metrics gives RSS, the heap's mapped, in-use and free bytes, its trims, and (with the server's
REFORMER_DEBUG_MEMORY, on by default for a server started here) live tensor bytes and Python objects. Once
the load stops and the server has been idle past its idle trim, one more sample (`after_idle`) shows what
the trim gave back. The JSON result holds the samples, latency percentiles per `--window-minutes`, the
errors by kind (5xx, unexpected statuses, transport errors, timeouts, truncated streams; the last three are
lost requests) and the verdict against the targets (bench/serving/soak_report.py). Without --url it starts
`python -m service` itself.

Count-based (the quick check tests/service/api/test_soak.py runs): no queued or running work, no decode cache
and no extra threads left after `--requests` mixed requests, and resident memory after them:

    python bench/serving/soak.py --requests 2000 [--artifact DIR | --url URL] [--out bench/results/soak.json.gz]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.table import Table

# run as a script, this checkout's bench/ (not an installed copy) must be the one imported
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.results_io import write_json  # noqa: E402
from bench.serving.overload import REPO, local_server_process, metric  # noqa: E402
from bench.serving.soak_load import Prompts, plan, send  # noqa: E402
from bench.serving.soak_report import Record, error_counts, memory_sample, verdict, windows  # noqa: E402
from service.observability.memory_metrics import DEBUG_MIN_INTERVAL_S  # noqa: E402
from train.corpus_manifest import set_folder  # noqa: E402

TEXT = "The Reformer uses locality-sensitive hashing to attend over long documents. "


def request_plan(i: int) -> tuple[str, dict[str, Any], set[int]]:
    """The i-th request of the mix: (path, body, statuses it may get)."""
    size = 1 + (i * 37) % 300
    text = (TEXT * 5)[:size]
    kind = i % 8
    if kind == 0:
        return "/generate", {"inputs": text, "parameters": {"max_new_tokens": 4 + i % 8, "seed": i,
                                                              "do_sample": True}}, {200}
    if kind == 1:
        return "/generate_stream", {"inputs": text, "parameters": {"max_new_tokens": 4}}, {200}
    if kind in (2, 3):
        return "/embed", {"inputs": [text, text[: size // 2 + 1]]}, {200}
    if kind == 4:
        return "/v1/completions", {"prompt": text, "max_tokens": 4}, {200}
    if kind == 5:
        return "/v1/embeddings", {"input": text}, {200}
    if kind == 6:
        return "/tokenize", {"inputs": text}, {200}
    return "/generate", {"inputs": "", "parameters": {"top_p": 3}}, {422}


async def run_mix(url: str, count: int, concurrency: int, offset: int = 0) -> dict[str, int]:
    """Send `count` requests of the mix, `concurrency` at a time; every 50th client leaves mid-request."""
    counts = {"ok": 0, "unexpected": 0, "abandoned": 0}
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(i: int) -> None:
            path, body, allowed = request_plan(i)
            async with semaphore:
                if i % 50 == 49:  # a client that goes away mid-stream
                    long = {"inputs": "leave", "parameters": {"max_new_tokens": 64, "ignore_eos": True}}
                    async with client.stream("POST", "/generate_stream", json=long) as r:
                        async for _ in r.aiter_lines():
                            break
                    counts["abandoned"] += 1
                    return
                r = await client.post(path, json=body)
                counts["ok" if r.status_code in allowed else "unexpected"] += 1

        await asyncio.gather(*(one(offset + i) for i in range(count)))
    return counts


async def settle(url: str) -> dict[str, float]:
    """Wait until the engine is idle (dropped work is released at the worker's next step), then read it."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for _ in range(300):
            text = (await client.get("/metrics")).text
            busy = sum(metric(text, n) for n in ("reformer_running_generations", "reformer_decode_cache_bytes"))
            queued = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("reformer_queue_size{"))
            if busy == 0 and queued == 0:
                break
            await asyncio.sleep(0.05)
    return {
        "rss_bytes": metric(text, "process_resident_memory_bytes"),
        "queued": queued,
        "running_generations": metric(text, "reformer_running_generations"),
        "decode_cache_bytes": metric(text, "reformer_decode_cache_bytes"),
        "inflight_requests": metric(text, "reformer_inflight_requests"),
    }


def run_soak(url: str, requests: int, concurrency: int = 8, warmup: int = 200,
             pid: int | None = None) -> dict[str, Any]:
    """Warm up, measure, run the mix, measure again; returns the report."""
    warm = asyncio.run(run_mix(url, warmup, concurrency))
    before = asyncio.run(settle(url))
    threads_before = psutil.Process(pid).num_threads() if pid else None
    main = asyncio.run(run_mix(url, requests, concurrency, offset=warmup))
    after = asyncio.run(settle(url))
    threads_after = psutil.Process(pid).num_threads() if pid else None
    growth = (after["rss_bytes"] - before["rss_bytes"]) / before["rss_bytes"]
    return {
        "requests": requests, "concurrency": concurrency, "warmup_requests": warmup,
        "warmup_unexpected": warm["unexpected"], "ok": main["ok"], "unexpected": main["unexpected"],
        "abandoned": main["abandoned"],
        "rss_after_warmup_mb": before["rss_bytes"] / 2**20, "rss_after_mb": after["rss_bytes"] / 2**20,
        "rss_growth_ratio": growth,
        "threads_after_warmup": threads_before, "threads_after": threads_after,
        "leftover_queued": after["queued"], "leftover_running": after["running_generations"],
        "leftover_cache_bytes": after["decode_cache_bytes"],
        "inflight_during_final_scrape": after["inflight_requests"],
    }


async def _scrape(client: httpx.AsyncClient, t_s: float) -> dict[str, Any]:
    began = time.perf_counter()
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError as exc:
        return {"t_s": round(t_s, 3), "error": repr(exc)}
    return {**memory_sample(text, t_s), "scrape_s": round(time.perf_counter() - began, 4)}


def _progress(sample: dict[str, Any], records: list[Record]) -> None:
    def mb(key: str) -> str:
        value = sample.get(key)
        return "-" if value is None else f"{value / 2**20:.0f}"

    errors = error_counts(records)
    print(f"t={sample['t_s']:7.1f}s rss={mb('rss_bytes')}MB heap_in_use={mb('heap_in_use_bytes')}MB "
          f"heap_free={mb('heap_free_retained_bytes')}MB tensors_resident={mb('live_tensor_resident_bytes')}MB "
          f"objects={sample.get('python_objects')} requests={errors['requests']} 5xx={errors['http_5xx']} "
          f"lost={errors['lost']} unexpected={errors['unexpected_status']}", file=sys.stderr, flush=True)


async def _after_idle(url: str, idle_trim_s: float, t0: float) -> dict[str, Any]:
    """Wait until nothing runs or waits, then past the server's idle trim and past the age at which the
    server recomputes its debug figures (else they would predate the trim); one more sample."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for _ in range(1200):
            sample = await _scrape(client, time.perf_counter() - t0)
            busy = sum(sample.get(k) or 0 for k in ("running_generations", "queued_generate", "queued_embed"))
            if "error" not in sample and busy == 0:
                break
            await asyncio.sleep(0.25)
        await asyncio.sleep(max(idle_trim_s, DEBUG_MIN_INTERVAL_S) + 2.0)
        return await _scrape(client, time.perf_counter() - t0)


async def timed_soak(url: str, minutes: float, clients: int, window_s: float, sample_s: float, long_every: int,
                     prompts: Prompts, request_timeout_s: float = 600.0) -> dict[str, Any]:
    """Run the mix for `minutes` and summarise it (bench/serving/soak_report.py)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as probe:
        info = (await probe.get("/info")).json()
    limits = info.get("limits") or {}
    longest = max(256, int(limits.get("max_input_tokens", 65_536)) - 64)  # room for the new tokens
    duration = minutes * 60.0
    records: list[Record] = []
    samples: list[dict[str, Any]] = []
    numbers = itertools.count()
    async with httpx.AsyncClient(base_url=url, timeout=60) as probe:
        before = await _scrape(probe, 0.0)  # idle, before any load: the reference for idle-to-idle growth
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    deadline = t0 + duration

    async with httpx.AsyncClient(base_url=url, timeout=request_timeout_s,
                                 limits=httpx.Limits(max_connections=clients + 2)) as client:

        async def one_client() -> None:
            while time.perf_counter() < deadline:  # a request in flight at the deadline finishes
                records.append(await send(client, plan(next(numbers), prompts, long_every, longest), t0))

        async def sampler() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=60) as scraper:
                for k in itertools.count():
                    at = min(k * sample_s, duration)
                    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                    # stamped with its scheduled time, so the last one is the run's end (t_s == duration) and
                    # the windows and the verdict's reference points fall on the schedule; late_s says by how much
                    # the scrape started after it
                    late = time.perf_counter() - t0 - at
                    samples.append({**await _scrape(scraper, at), "late_s": round(late, 3)})
                    _progress(samples[-1], records)
                    if at >= duration:
                        return

        await asyncio.gather(sampler(), *(one_client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    idle_trim_s = float((info.get("memory") or {}).get("idle_trim_s") or 0.0)
    after_idle = await _after_idle(url, idle_trim_s, t0)
    errors = error_counts(records)
    wins = windows(records, window_s, duration)
    return {
        "benchmark": "soak", "mode": "timed", "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(), "minutes": minutes, "clients": clients, "window_s": window_s,
        "sample_s": sample_s, "long_every": long_every, "prompt_sources": prompts.sources,
        "server": {key: info.get(key) for key in ("model_id", "version", "device", "limits", "memory", "settings")},
        "host": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "duration_s": duration, "wall_s": round(wall, 2),
        "errors": errors, "requests_by_kind": dict(Counter(r.kind for r in records)),
        "windows": wins, "before": before, "samples": samples, "after_idle": after_idle,
        "verdict": verdict(samples, wins, errors, duration, before, after_idle),
    }


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def print_timed(report: dict[str, Any]) -> None:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    table = Table(title=f"soak: {report['minutes']} min, {report['clients']} clients, "
                        f"{report['errors']['requests']} requests")
    for column in ("window", "answered", "p50 s", "p95 s", "p99 s", "max s", "not ok"):
        table.add_column(column, justify="right")
    for w in report["windows"]:
        bad = sum(v for k, v in w["outcomes"].items() if k != "ok")
        table.add_row(f"{w['start_s'] / 60:.1f}-{w['end_s'] / 60:.1f} min", str(w["count"]), s(w["p50_s"]),
                      s(w["p95_s"]), s(w["p99_s"]), s(w["max_s"]), str(bad))
    Console().print(table)
    v = report["verdict"]
    mb = {k: None if v[k] is None else round(v[k] / 2**20, 1)
          for k in ("rss_reference_bytes", "rss_end_bytes", "rss_after_idle_bytes")}
    print(f"errors: {report['errors']}")
    print(f"RSS at {v['rss_reference_t_s'] / 60:.1f} min {mb['rss_reference_bytes']} MB, at the end "
          f"{mb['rss_end_bytes']} MB (ratio {s(v['rss_ratio'])}), after idle {mb['rss_after_idle_bytes']} MB")
    print(f"idle to idle: { {k: g for k, g in v['idle_to_idle_growth'].items()} }")
    print(f"reading: {v['reading']}")
    print(f"p99 second window {s(v['p99_second_window_s'])} s, last {s(v['p99_last_window_s'])} s "
          f"(ratio {s(v['p99_ratio'])})")
    print(f"checks: {v['checks']} -> {'PASS' if v['passed'] else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--artifact", help="artifact to serve (default: the shipped one)")
    parser.add_argument("--url", help="a running server to use instead of starting one")
    parser.add_argument("--minutes", type=float, default=60.0, help="timed soak: its length")
    parser.add_argument("--clients", type=int, default=6, help="timed soak: clients sending back to back")
    parser.add_argument("--window-minutes", type=float, default=10.0, help="timed soak: latency windows")
    parser.add_argument("--sample-s", type=float, default=10.0, help="timed soak: /metrics sampling period")
    parser.add_argument("--long-every", type=int, default=200, help="timed soak: every n-th request a 32-64 KB "
                        "prompt (0: none)")
    parser.add_argument("--data", type=Path, action="append",
                        help="directories of *.txt books for the prompts (default: corpus/data and corpus/corpus, as "
                             "`reformer data` writes them)")
    parser.add_argument("--idle-trim-s", type=float, help="server started here: REFORMER_IDLE_TRIM_S")
    parser.add_argument("--busy-trim-s", type=float, help="server started here: REFORMER_BUSY_TRIM_S")
    parser.add_argument("--memory-budget-mb", type=int, help="server started here: REFORMER_MEMORY_BUDGET_MB")
    parser.add_argument("--debug-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="server started here: REFORMER_DEBUG_MEMORY (live tensor bytes, Python objects)")
    parser.add_argument("--requests", type=int, help="the count-based check instead of the timed soak")
    parser.add_argument("--concurrency", type=int, default=8, help="count-based check: requests at a time")
    parser.add_argument("--out", help="result JSON, gzip-compressed when the name ends in .gz (default "
                                      "bench/results/soak_<minutes>min.json.gz, or soak.json.gz)")
    args = parser.parse_args(argv)
    timed = args.requests is None
    default_out = f"soak_{args.minutes:g}min.json.gz" if timed else "soak.json.gz"
    out = Path(args.out or REPO / "bench" / "results" / default_out)
    if timed:
        prompts = Prompts(args.data or [set_folder("data"), set_folder("corpus")])
        window_s = args.window_minutes * 60.0

        def run(url: str, pid: int | None) -> dict[str, Any]:
            return asyncio.run(timed_soak(url, args.minutes, args.clients, window_s, args.sample_s, args.long_every,
                                          prompts))
    else:
        def run(url: str, pid: int | None) -> dict[str, Any]:
            return run_soak(url, args.requests, args.concurrency, pid=pid)
    if args.url:
        report = run(args.url, None)
    else:
        settings: dict[str, Any] = {"max_new_tokens": 256}
        if timed:
            settings["debug_memory"] = args.debug_memory
            settings.update({k: v for k, v in (("idle_trim_s", args.idle_trim_s), ("busy_trim_s", args.busy_trim_s),
                                                ("memory_budget_mb", args.memory_budget_mb)) if v is not None})
        log_path = Path(tempfile.gettempdir()) / "reformer-soak-server.log"
        print(f"server log: {log_path}", file=sys.stderr)
        with local_server_process(args.artifact, log_path, **settings) as server:
            report = run(server.url, server.proc.pid)
    if timed:
        print_timed(report)
    else:
        print_counted(report, args.requests)
    write_json(out, report)
    print(f"wrote {out}")
    return 0 if not timed or report["verdict"]["passed"] else 1


def print_counted(report: dict[str, Any], requests: int) -> None:
    table = Table(title=f"soak: {requests} mixed requests")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in report.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
