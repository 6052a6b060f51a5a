"""Soak benchmark (issue 8): mixed requests (generate, stream, embed, /v1, tokenize, bad inputs, clients that
leave) against one server; resident memory must grow less than 10% after warm-up, and nothing may leak:
no queued or running work, no decode cache, no extra threads.

    python bench/soak.py [--artifact DIR | --url URL] [--requests 2000] [--out bench/results/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from bench.overload import REPO, local_server, metric

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", help="artifact to serve (default: the shipped one)")
    parser.add_argument("--url", help="a running server to use instead of starting one")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "soak.json"))
    args = parser.parse_args(argv)
    if args.url:
        report = run_soak(args.url, args.requests, args.concurrency)
    else:
        log_path = Path(tempfile.gettempdir()) / "reformer-soak-server.log"
        print(f"server log: {log_path}", file=sys.stderr)
        with local_server(args.artifact, log_path, max_new_tokens=256) as (url, proc):
            report = run_soak(url, args.requests, args.concurrency, pid=proc.pid)
    table = Table(title=f"soak: {args.requests} mixed requests")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in report.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
