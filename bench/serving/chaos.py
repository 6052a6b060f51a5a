"""A chaos run against a loopback server (issue 54, item 8): clients that leave at random points (queued,
mid-prefill, mid-decode, mid-stream, mid-embed), n/best_of requests, bodies that are huge, bad or sent too
slowly, and streams read slowly. Afterwards nothing may be lost:

- no 5xx answer;
- every answer delivered in full equals the same request run alone before the load (the server runs
  batch-invariant, and sampled requests carry a seed; embedding vectors within 1e-5);
- the queue and the decode cache empty (/metrics: reformer_queue_size, reformer_running_generations,
  reformer_decode_cache_bytes{state="allocated"} back to 0);
- the server's CPU idle (under 10% of a core over 250 ms) within 1 s of the last client leaving;
- its RSS at most 5% above its value before the load (taken after the reference pass has warmed it, and both
  after an idle trim), not counting what the caches keep by design: the prefix cache's states and the decode
  cache's resident pool pages (/metrics), which the load may leave larger than before;
- answers compare without TGI's `details.cached_tokens` (how much of the prompt a request in flight had
  prefilled is a report of the moment, like the timing headers).

    python bench/serving/chaos.py [--artifact DIR] [--seconds 60] [--clients 16] [--seed 0]
        [--out bench/results/chaos.json]

tests/bench/serving/test_chaos.py runs a short form on the tiny test model. The scenarios and checks are in
bench/serving/chaos_clients.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the tree's packages are importable
    sys.path.insert(0, str(REPO))

from bench.server_process import ServerProcess, service_argv  # noqa: E402
from bench.serving.chaos_clients import Chaos, metric_sum  # noqa: E402

# the server's settings for a chaos run: batch-invariant (an answer equals the request alone, bit for bit), a
# short queue (so requests wait in it and some get 429), short body timeout (slow senders get 408 quickly)
SERVER_SETTINGS = {"batch_invariant": "true", "max_queue_size": 8, "body_timeout_s": 1.5, "max_payload_bytes": 200_000,
                   "max_new_tokens": 64, "max_input_tokens": 1800, "idle_trim_s": 0.5, "log_level": "warning"}
IDLE_CPU_FRACTION = 0.10
IDLE_WINDOW_S = 0.25
IDLE_WITHIN_S = 1.0
RSS_TOLERANCE = 0.05  # growth only: an RSS below the one before the load is memory given back, not lost
TRIM_WAIT_S = 3.0  # past the server's idle_trim_s (2 s by default), so both readings follow a trim


def settled(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Wait until nothing is queued, running or held in the decode cache; the figures then."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=30) as client:
        while True:
            text = client.get("/metrics").text
            figures = {"queue_size": metric_sum(text, "reformer_queue_size"),
                       "running_generations": metric_sum(text, "reformer_running_generations"),
                       "decode_cache_allocated_bytes": metric_sum(text, "reformer_decode_cache_bytes",
                                                                  {"state": "allocated"})}
            if not any(figures.values()) or time.monotonic() > deadline:
                return figures
            time.sleep(0.05)


def seconds_to_idle(pid: int, watch_s: float = 3.0) -> float | None:
    """Seconds from now until the process's CPU use over IDLE_WINDOW_S first falls under IDLE_CPU_FRACTION of a
    core (None: not within `watch_s`)."""
    process = psutil.Process(pid)
    start = time.monotonic()
    samples = [(start, sum(process.cpu_times()[:2]))]
    while time.monotonic() - start < watch_s:
        time.sleep(0.025)
        now = time.monotonic()
        samples.append((now, sum(process.cpu_times()[:2])))
        for t0, c0 in samples:
            if now - t0 >= IDLE_WINDOW_S:
                window_start, window_cpu = t0, c0
        if now - start >= IDLE_WINDOW_S:
            if (samples[-1][1] - window_cpu) / (now - window_start) < IDLE_CPU_FRACTION:
                return max(window_start - start, 0.0)
    return None


def rss_after_trim(url: str, pid: int, wait_s: float) -> int:
    """The server's RSS once it has been idle long enough to trim (idle_trim_s) and settle."""
    time.sleep(wait_s)
    return int(psutil.Process(pid).memory_info().rss)


def kept_bytes(url: str) -> float:
    """What the server keeps by design after a load: the prefix cache's states (up to its capacity) and the
    decode cache's resident pool pages (up to REFORMER_CACHE_KEEP_MB of free blocks stay resident)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    states = sum(metric_sum(text, "reformer_prefix_cache_bytes", {"state": s}) for s in ("referenced", "evictable"))
    return states + metric_sum(text, "reformer_decode_cache_resident_bytes")


def run(url: str, pid: int, seconds: float, clients: int, seed: int, limits: dict[str, Any]) -> dict[str, Any]:
    chaos = Chaos(url, seed, limits)
    asyncio.run(chaos.references())
    settled(url)
    rss_before = rss_after_trim(url, pid, TRIM_WAIT_S)
    kept_before = kept_bytes(url)
    load_before = os.getloadavg()
    asyncio.run(chaos.storm(seconds, clients))
    last_left = time.monotonic()
    idle_after = seconds_to_idle(pid)
    noticed_at = time.monotonic() - last_left
    after = settled(url)
    rss_after = rss_after_trim(url, pid, TRIM_WAIT_S)
    kept_after = kept_bytes(url)
    report = chaos.report()
    report.update({
        "seconds": seconds, "clients": clients, "seed": seed,
        "after": after, "cpu_idle_after_last_client_s": idle_after, "idle_watch_ended_s": noticed_at,
        "rss_before_bytes": rss_before, "rss_after_bytes": rss_after,
        "rss_change": (rss_after - rss_before) / rss_before,
        "kept_bytes_before": kept_before, "kept_bytes_after": kept_after,
        # what the caches keep by design is not a leak: RSS is compared without it (`kept_bytes`)
        "rss_change_without_caches": ((rss_after - kept_after) - (rss_before - kept_before))
        / (rss_before - kept_before),
        "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
    })
    report["checks"] = {
        "no_5xx": report["statuses_5xx"] == 0,
        "nothing_lost": report["lost"] == [],
        "answers_equal_alone": report["mismatches"] == [],
        "queue_and_cache_empty": not any(after.values()),
        "cpu_idle_within_1s": idle_after is not None and idle_after <= IDLE_WITHIN_S,
        "rss_within_5pct": report["rss_change_without_caches"] <= RSS_TOLERANCE,
    }
    return report


def server_settings(extra: dict[str, Any] | None = None) -> dict[str, str]:
    return {f"REFORMER_{k.upper()}": str(v) for k, v in {**SERVER_SETTINGS, **(extra or {})}.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default=None, help="artifact directory (default: the shipped model)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "chaos.json"))
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="chaos-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **server_settings()}
    with ServerProcess(service_argv(args.artifact), log_path=logs / "server.log", env=env, cwd=REPO) as server:
        server.wait_ready(300, poll_s=0.1)
        report = run(server.url, server.proc.pid, args.seconds, args.clients, args.seed, SERVER_SETTINGS)
    table = Table(title=f"chaos: {args.clients} clients for {args.seconds:g} s, seed {args.seed} "
                        f"(load {report['load_average_before'][0]:.2f} before, "
                        f"{report['load_average_after'][0]:.2f} after)")
    table.add_column("check")
    table.add_column("value")
    table.add_column("ok")
    values = {"no_5xx": report["statuses_5xx"], "nothing_lost": len(report["lost"]),
              "answers_equal_alone": len(report["mismatches"]),
              "queue_and_cache_empty": report["after"], "cpu_idle_within_1s": report["cpu_idle_after_last_client_s"],
              "rss_within_5pct": f"{report['rss_change_without_caches']:+.2%} "
                                 f"({report['rss_change']:+.2%} with the caches' pages)"}
    for name, ok in report["checks"].items():
        table.add_row(name, str(values[name]), "yes" if ok else "NO")
    console = Console()
    console.print(table)
    console.print(f"outcomes: {report['outcomes']}")
    console.print(f"statuses: {report['statuses']}; dropped by stage: {report['dropped']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
