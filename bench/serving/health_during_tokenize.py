"""/health latency while the largest allowed requests are being tokenized (issue 54, item 3): tokenizing runs on
the service's tokenize threads (service/text/tokenizing.py), never on the event loop, so /health stays fast while
bodies of max_payload_bytes are tokenized. The bar: /health p99 under 50 ms during the load.

A prober sends GET /health every 10 ms on one keep-alive connection; first with the server idle (the anchor),
then while `--clients` loaders post, back to back, bodies just under max_payload_bytes to the routes that
tokenize them: /tokenize (vLLM's `prompt` with token strings, and TGI's `inputs` with offsets) and /generate
and /v1/embeddings (tokenized whole, then refused 422 for length). Each loader is a process of its own and
discards its answer as it arrives. Prints a table with the load average beside it and writes JSON.

    python bench/serving/health_during_tokenize.py [--artifact DIR] [--seconds 20] [--clients 4]
        [--out bench/results/health_during_tokenize.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the tree's packages are importable
    sys.path.insert(0, str(REPO))

from bench.server_process import ServerProcess, service_argv  # noqa: E402

BUDGET_P99_S = 0.050
PROBE_EVERY_S = 0.010


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def summary(latencies: list[float]) -> dict[str, float]:
    return {"samples": len(latencies), "p50_ms": percentile(latencies, 0.5) * 1000,
            "p99_ms": percentile(latencies, 0.99) * 1000, "max_ms": max(latencies, default=float("nan")) * 1000,
            "mean_ms": statistics.fmean(latencies) * 1000 if latencies else float("nan")}


def probe(url: str, seconds: float) -> list[float]:
    """GET /health every PROBE_EVERY_S for `seconds`: each one's latency."""
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as client:
        client.get("/health")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            began = time.perf_counter()
            r = client.get("/health")
            latencies.append(time.perf_counter() - began)
            if r.status_code != 200:
                raise RuntimeError(f"/health answered {r.status_code}")
            time.sleep(PROBE_EVERY_S)
    return latencies


def bodies(max_bytes: int) -> list[tuple[str, bytes]]:
    """The largest bodies each tokenizing route accepts: a text filling all but a margin of max_payload_bytes."""
    text_len = max_bytes - 1024
    words = ("tokenize these words while health is probed " * (text_len // 44 + 1))[:text_len]
    made = [("/tokenize", {"prompt": words, "return_token_strs": True}),
            ("/tokenize", {"inputs": words}),
            ("/generate", {"inputs": words, "parameters": {"max_new_tokens": 1}}),
            ("/v1/embeddings", {"input": words})]
    return [(path, json.dumps(body).encode()) for path, body in made]


def load(url: str, work: list[tuple[str, bytes]], stop: Any, results: Any, offset: int) -> None:
    """One loader (a process of its own, so its reading of large answers never delays the prober): posts the
    bodies in turn until `stop`, then puts its count of answers by route and status on `results`."""
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=600) as client:
        i = offset
        while not stop.is_set():
            path, body = work[i % len(work)]
            i += 1
            with client.stream("POST", path, content=body, headers={"content-type": "application/json"}) as r:
                for _ in r.iter_raw(1 << 20):
                    pass
            key = f"{path} {r.status_code}"
            statuses[key] = statuses.get(key, 0) + 1
    results.put(statuses)


def run(url: str, seconds: float, clients: int, max_bytes: int) -> dict[str, Any]:
    idle = probe(url, min(seconds, 5.0))
    work = bodies(max_bytes)
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    loaders = [context.Process(target=load, args=(url, work, stop, results, i), daemon=True) for i in range(clients)]
    load_before = os.getloadavg()
    for process in loaders:
        process.start()
    time.sleep(2.0)  # the loaders have started and their first bodies are on their way
    busy = probe(url, seconds)
    stop.set()
    statuses: dict[str, int] = {}
    for _ in loaders:
        for key, count in results.get(timeout=600).items():
            statuses[key] = statuses.get(key, 0) + count
    for process in loaders:
        process.join(60)
    return {"idle": summary(idle), "during_tokenize": summary(busy), "requests": statuses,
            "clients": clients, "body_bytes": [len(b) for _, b in work],
            "p99_over_idle_p99": percentile(busy, 0.99) / percentile(idle, 0.99),
            "budget_p99_ms": BUDGET_P99_S * 1000, "within_budget": percentile(busy, 0.99) < BUDGET_P99_S,
            "load_average_before": list(load_before), "load_average_after": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default=None, help="artifact directory (default: the shipped model)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long /health is probed under load")
    parser.add_argument("--clients", type=int, default=4, help="concurrent loaders posting large bodies")
    parser.add_argument("--max-payload-bytes", type=int, default=4_000_000)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "health_during_tokenize.json"))
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="health-tokenize-"))
    env = {**os.environ, "REFORMER_MAX_PAYLOAD_BYTES": str(args.max_payload_bytes)}
    with ServerProcess(service_argv(args.artifact, "--log-level", "warning"), log_path=logs / "server.log",
                       env=env, cwd=REPO) as server:
        server.wait_ready(180, poll_s=0.1)
        report = run(server.url, args.seconds, args.clients, args.max_payload_bytes)
    report["server"] = {"tokenize_threads": int(os.environ.get("REFORMER_TOKENIZE_THREADS", "2")),
                        "cpu_count": os.cpu_count()}
    table = Table(title=f"/health while {args.clients} clients post {args.max_payload_bytes}-byte bodies "
                        f"(load {report['load_average_before'][0]:.2f} before, "
                        f"{report['load_average_after'][0]:.2f} after)")
    for column in ("phase", "samples", "p50 ms", "p99 ms", "max ms"):
        table.add_column(column)
    for phase in ("idle", "during_tokenize"):
        s = report[phase]
        table.add_row(phase, str(s["samples"]), f"{s['p50_ms']:.1f}", f"{s['p99_ms']:.1f}", f"{s['max_ms']:.1f}")
    console = Console()
    console.print(table)
    console.print(f"requests: {report['requests']}; p99 / idle p99 = {report['p99_over_idle_p99']:.2f}; "
                  f"within the 50 ms budget: {report['within_budget']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if report["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
