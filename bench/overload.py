"""Overload benchmark (issue 8): at four times the queue's capacity, the excess must get 429 with Retry-After
within 50 ms, every admitted request must complete, and memory must stay bounded; a request that waits
past the timeout must get 504.

    python bench/overload.py [--artifact DIR | --url URL] [--out bench/results/overload.json]

Without --url it starts `python -m service` itself (two servers: one for the burst, one with a short
request timeout for the 504 probe). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
REJECT_BUDGET_S = 0.050


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_server(artifact: str | None, **settings: Any) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`python -m service` on a free loopback port until the block ends (SIGTERM, then wait)."""
    port = free_port()
    env = {**os.environ, **{f"REFORMER_{k.upper()}": str(v) for k, v in settings.items()}}
    args = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if artifact:
        args.insert(3, artifact)
    proc = subprocess.Popen(args, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server not ready in 180 s")
            time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(60)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def burst(url: str, count: int, new_tokens: int) -> dict[str, Any]:
    """Send `count` generation requests at once; record status, latency and Retry-After of each."""
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=count + 8)
    rss: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        rss.append(metric((await client.get("/metrics")).text, "process_resident_memory_bytes"))
        body = {"inputs": "overload " * 8, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}

        async def one(i: int) -> dict[str, Any]:
            started = time.perf_counter()
            r = await client.post("/generate", json=body)
            return {"status": r.status_code, "latency_s": time.perf_counter() - started,
                    "retry_after": r.headers.get("retry-after")}

        async def sample_memory(stop: asyncio.Event) -> None:
            while not stop.is_set():
                rss.append(metric((await client.get("/metrics")).text, "process_resident_memory_bytes"))
                await asyncio.sleep(0.25)

        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_memory(stop))
        results = await asyncio.gather(*(one(i) for i in range(count)))
        stop.set()
        await sampler
        rss.append(metric((await client.get("/metrics")).text, "process_resident_memory_bytes"))
    rejected = [r for r in results if r["status"] == 429]
    ok = [r for r in results if r["status"] == 200]
    other = [r for r in results if r["status"] not in (200, 429)]
    reject_latency = [r["latency_s"] for r in rejected]
    return {
        "requests": count,
        "completed_200": len(ok),
        "rejected_429": len(rejected),
        "other_status": sorted({r["status"] for r in other}),
        "other_count": len(other),
        "rejected_with_retry_after": sum(1 for r in rejected if r["retry_after"]),
        "reject_latency_p50_ms": percentile(reject_latency, 0.5) * 1000,
        "reject_latency_p99_ms": percentile(reject_latency, 0.99) * 1000,
        "reject_latency_max_ms": max(reject_latency, default=float("nan")) * 1000,
        "rejects_within_50ms": sum(1 for x in reject_latency if x <= REJECT_BUDGET_S),
        "admitted_latency_p50_s": percentile([r["latency_s"] for r in ok], 0.5),
        "rss_before_mb": rss[0] / 2**20,
        "rss_peak_mb": max(rss) / 2**20,
        "rss_after_mb": rss[-1] / 2**20,
    }


async def timeout_probe(url: str, count: int, new_tokens: int) -> dict[str, Any]:
    """Saturate a server whose request timeout is short: the ones left waiting must get 504."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        body = {"inputs": "slow", "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}

        async def one() -> tuple[int, float]:
            started = time.perf_counter()
            r = await client.post("/generate", json=body)
            return r.status_code, time.perf_counter() - started

        results = await asyncio.gather(*(one() for _ in range(count)))
    timed_out = [t for s, t in results if s == 504]
    return {"requests": count, "timeout_504": len(timed_out),
            "completed_200": sum(1 for s, _ in results if s == 200),
            "other_count": sum(1 for s, _ in results if s not in (200, 504)),
            "timeout_latency_median_s": statistics.median(timed_out) if timed_out else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", help="artifact to serve (default: the shipped one)")
    parser.add_argument("--url", help="a running server to use instead of starting one (burst only)")
    parser.add_argument("--queue-size", type=int, default=16, help="max_queue_size of the started server")
    parser.add_argument("--batch-size", type=int, default=4, help="max_batch_size of the started server")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--timeout-s", type=float, default=0.5, help="request_timeout_s for the 504 probe")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "overload.json"))
    args = parser.parse_args(argv)

    report: dict[str, Any] = {}
    if args.url:
        info = httpx.get(args.url + "/info", timeout=30).json()["batching"]
        capacity = info["max_queue_size"] + info["max_batch_size"]
        report["burst"] = asyncio.run(burst(args.url, 4 * capacity, args.new_tokens))
    else:
        capacity = args.queue_size + args.batch_size
        with local_server(args.artifact, max_queue_size=args.queue_size, max_batch_size=args.batch_size,
                          max_new_tokens=max(args.new_tokens, 1024)) as (url, _):
            report["burst"] = asyncio.run(burst(url, 4 * capacity, args.new_tokens))
        with local_server(args.artifact, max_queue_size=args.queue_size, max_batch_size=1,
                          request_timeout_s=args.timeout_s, max_new_tokens=max(args.new_tokens, 1024)) as (url, _):
            report["timeout"] = asyncio.run(timeout_probe(url, args.queue_size, args.new_tokens * 4))
    report["capacity"] = capacity
    report["reject_budget_ms"] = REJECT_BUDGET_S * 1000

    table = Table(title=f"overload: {4 * capacity} requests at once against capacity {capacity}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for section, figures in report.items():
        if isinstance(figures, dict):
            for key, value in figures.items():
                table.add_row(f"{section}.{key}", f"{value:.2f}" if isinstance(value, float) else str(value))
    Console().print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
