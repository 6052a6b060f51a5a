"""What tracing costs and whether it loses spans (issue 57): the soak's mixed load (bench/serving/soak_load.py)
against the same server with tracing off and on, and one long prompt per length traced, all exported over
OTLP/HTTP to a receiver in this process (bench/serving/otlp_receiver.py).

    python bench/serving/tracing_overhead.py [--artifact DIR] [--data corpus/data --data corpus/corpus]
        [--requests 48] [--rounds 4] [--warmup-rounds 1] [--clients 6] [--long-every 24]
        [--span-lengths 5000,64000]
        [--out bench/results/tracing_overhead.json]

Two servers (`python -m service`, the same settings, the prefix cache off) run side by side, one at a time under
load: "off" (OTEL_SDK_DISABLED=true) and "on" (OTEL_EXPORTER_OTLP_ENDPOINT at the receiver, the SDK's default
batch processor). Each round sends the same `--requests` requests of the soak's mix (requests 0..n-1: the same
prompts, sizes and kinds every round; every `--long-every`-th a 32-64 KB prompt), `--clients` at a time, to one
server; after `--warmup-rounds` uncounted rounds on each (the first touches of the heap and the decode cache's
pages), the rounds go off, on, on, off, ... (ABBA, so a drift of the machine's speed over the run falls on
both). Tokens/s of a round: the server's prompt and generated tokens (`/metrics` counters, read before and
after) over the round's wall time. The overhead is 1 - (on's tokens over on's time) / (off's tokens over off's
time), all rounds pooled; target: at most 3%. `--rounds 0 --warmup-rounds 0`: only the traced prompts.

Then, on the "on" server with nothing else running, one `/generate` (4 new tokens) per `--span-lengths` prompt
of book text (bytes: tokens, for the byte-level tokenizer), with a client `traceparent`: the spans of its
trace and its `prefill` span's attributes. Last, both servers stop (SIGTERM: the "on" server flushes and logs
the spans it ended and exported); lost spans: those it ended that the receiver did not get. Every request
sent to "on" must have its request span.

Prints a table with the machine's load and writes the JSON. Run it alone (bench/quiet_run.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the tree's packages are importable
    sys.path.insert(0, str(REPO))

from bench.server_process import ServerProcess, service_argv  # noqa: E402
from bench.serving.otlp_receiver import OtlpReceiver, ReceivedSpan  # noqa: E402
from bench.serving.overload import metric  # noqa: E402
from bench.serving.soak_load import Prompts, plan, send  # noqa: E402
from bench.serving.soak_report import OK  # noqa: E402

TARGET_OVERHEAD = 0.03
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
TRACEPARENT = "00-{trace}-00f067aa0ba902b7-01"
# the soak's server settings (bench/serving/soak.py), a decode cache both servers can map, and no prefix cache:
# every round sends the same prompts, which from the second round on it would serve without a prefill
SETTINGS = {"REFORMER_MAX_NEW_TOKENS": "256", "REFORMER_CACHE_BYTES": str(2 * 2**30), "REFORMER_PREFIX_CACHE": "false"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--artifact", help="artifact to serve (default: the shipped one)")
    p.add_argument("--data", type=Path, action="append",
                   help="directories of *.txt books (default: corpus/data and corpus/corpus)")
    p.add_argument("--requests", type=int, default=48, help="requests of the soak's mix per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds per server (ABBA order)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="uncounted rounds per server first")
    p.add_argument("--clients", type=int, default=6, help="requests at a time")
    p.add_argument("--long-every", type=int, default=24, help="every n-th request a 32-64 KB prompt (0: none)")
    p.add_argument("--span-lengths", default="5000,64000", help="prompt lengths (bytes) whose trace is counted")
    p.add_argument("--out", type=Path, default=REPO / "bench/results/tracing_overhead.json")
    p.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "tracing_overhead_logs")
    return p


def server_env(tracing_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(SETTINGS)
    if tracing_url is None:
        env["OTEL_SDK_DISABLED"] = "true"
    else:
        env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": tracing_url, "OTEL_SERVICE_NAME": "reformer-bench"})
    return env


def tokens_served(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return metric(text, "reformer_prompt_tokens_total") + metric(text, "reformer_generated_tokens_total")


def longest_prompt(url: str) -> int:
    """The longest prompt the mix may send (bytes: tokens), as the soak computes it."""
    limits = httpx.get(url + "/info", timeout=30).json().get("limits") or {}
    return max(256, int(limits.get("max_input_tokens", 65_536)) - 64)  # room for the new tokens


async def load_round(url: str, prompts: Prompts, args: argparse.Namespace) -> tuple[float, Counter[str]]:
    """The mix's requests 0..n-1, `clients` at a time: (wall seconds, outcomes)."""
    longest = longest_prompt(url)
    queue = list(range(args.requests))
    outcomes: Counter[str] = Counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()

        async def worker() -> None:
            while queue:
                record = await send(client, plan(queue.pop(0), prompts, args.long_every, longest), t0)
                outcomes[record.outcome] += 1

        await asyncio.gather(*(worker() for _ in range(args.clients)))
        return time.perf_counter() - t0, outcomes


def measure_rounds(servers: dict[str, ServerProcess], prompts: Prompts, args: argparse.Namespace
                   ) -> list[dict[str, Any]]:
    for _ in range(args.warmup_rounds):
        for arm in servers:
            asyncio.run(load_round(servers[arm].url, prompts, args))
    order = [("off", "on", "on", "off")[i % 4] for i in range(2 * args.rounds)]
    rounds = []
    for arm in order:
        url = servers[arm].url
        before = tokens_served(url)
        wall, outcomes = asyncio.run(load_round(url, prompts, args))
        tokens = tokens_served(url) - before
        rounds.append({"server": arm, "wall_s": round(wall, 3), "tokens": tokens,
                       "tokens_per_s": round(tokens / wall, 1), "outcomes": dict(outcomes),
                       "load_1min": os.getloadavg()[0]})
        print(f"  round {len(rounds)}: tracing {arm}, {tokens:.0f} tokens in {wall:.1f} s "
              f"({tokens / wall:.0f} tokens/s), load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return rounds


def book_prompt(prompts: Prompts, length: int) -> str:
    """`length` bytes of book text from its start, cut to whole characters."""
    return prompts.text[:length].decode("utf-8", "ignore")


def long_prompt_traces(url: str, receiver: OtlpReceiver, prompts: Prompts, lengths: list[int]
                       ) -> list[dict[str, Any]]:
    """One traced /generate per length; its trace's spans once the batch processor has sent them."""
    out = []
    for i, length in enumerate(lengths):
        trace_id = f"{0x5eed0000 + i:032x}"
        prompt = book_prompt(prompts, length)
        began = time.perf_counter()
        r = httpx.post(url + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 4}},
                       headers={"traceparent": TRACEPARENT.format(trace=trace_id)}, timeout=1800)
        took = time.perf_counter() - began
        r.raise_for_status()
        spans = wait_for_trace(receiver, trace_id)
        prefill = next((s for s in spans if s.name == "prefill"), None)
        out.append({"prompt_bytes": length, "prompt_tokens": int(r.headers["x-prompt-tokens"]),
                    "request_s": round(took, 2), "spans": len(spans), "span_names": [s.name for s in spans],
                    "prefill_attributes": prefill.attributes if prefill else None,
                    "prefill_events": len(prefill.events) if prefill else 0})
    return out


def wait_for_trace(receiver: OtlpReceiver, trace_id: str, timeout_s: float = 30.0) -> list[ReceivedSpan]:
    """The trace's spans once its request span (ended last) has arrived (the SDK exports every 5 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = receiver.traces().get(trace_id, [])
        if any(s.kind == SERVER_KIND for s in spans):
            return spans
        time.sleep(0.2)
    raise RuntimeError(f"trace {trace_id} did not reach the receiver in {timeout_s:.0f} s")


def tracing_counts(log_path: Path) -> dict[str, int] | None:
    """The counts the "on" server logged when its tracing stopped (service/observability/tracing_export.py)."""
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "spans_ended" in entry:
            return {"ended": int(entry["spans_ended"]), "exported": int(entry["spans_exported"])}
    return None


def span_report(receiver: OtlpReceiver, sent_to_on: Counter[str], logged: dict[str, int] | None) -> dict[str, Any]:
    spans = receiver.spans()
    per_trace = Counter(s.trace_id for s in spans)
    request_spans = Counter(s.name for s in spans if s.kind == SERVER_KIND)
    received = len(spans)
    return {
        "received": received, "traces": len(per_trace), "most_spans_in_a_trace": max(per_trace.values(), default=0),
        "spans_per_trace": dict(sorted(Counter(per_trace.values()).items())),
        "request_spans_by_route": dict(request_spans), "requests_sent_to_on_by_route": dict(sent_to_on),
        "every_request_has_its_span": all(request_spans[k] == n for k, n in sent_to_on.items()),
        "server_logged": logged, "lost": None if logged is None else logged["ended"] - received,
        "receiver_rejected": receiver.rejected,
    }


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The pooled tokens/s of each server and the overhead; None without rounds (--rounds 0: spans only)."""
    if not rounds:
        return None

    def rate(arm: str) -> float:
        picked = [r for r in rounds if r["server"] == arm]
        return sum(r["tokens"] for r in picked) / sum(r["wall_s"] for r in picked)

    off, on = rate("off"), rate("on")
    overhead = 1 - on / off
    return {"off_tokens_per_s": round(off, 1), "on_tokens_per_s": round(on, 1), "overhead": round(overhead, 4),
            "target": TARGET_OVERHEAD, "met": overhead <= TARGET_OVERHEAD}


def print_report(report: dict[str, Any]) -> None:
    console = Console()
    table = Table(title=f"tracing overhead, soak mix ({report['commit']}, {report['date']}); load before "
                        f"{report['load_before'][0]:.2f}, after {report['load_after'][0]:.2f}")
    for column in ("round", "tracing", "tokens", "wall s", "tokens/s", "load (1 min)"):
        table.add_column(column, justify="right")
    for i, r in enumerate(report["rounds"], 1):
        table.add_row(str(i), r["server"], f"{r['tokens']:.0f}", f"{r['wall_s']:.1f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['load_1min']:.2f}")
    console.print(table)
    s = report["summary"]
    if s is not None:
        console.print(f"pooled: off {s['off_tokens_per_s']:.0f} tokens/s, on {s['on_tokens_per_s']:.0f} tokens/s, "
                      f"overhead {100 * s['overhead']:.1f}% (target <= {100 * s['target']:.0f}%: "
                      f"{'met' if s['met'] else 'NOT met'})")
    spans = report["spans"]
    console.print(f"spans: server ended {spans['server_logged']}, receiver got {spans['received']} in "
                  f"{spans['traces']} traces, lost {spans['lost']}, at most {spans['most_spans_in_a_trace']} "
                  f"in a trace; every request has its span: {spans['every_request_has_its_span']}")
    long_table = Table(title="one traced /generate per prompt length")
    for column in ("prompt tokens", "spans in its trace", "prefill slices", "prefill total s", "longest slice s",
                   "slice events"):
        long_table.add_column(column, justify="right")
    for row in report["long_prompts"]:
        a = row["prefill_attributes"] or {}
        long_table.add_row(f"{row['prompt_tokens']:,}", str(row["spans"]), str(a.get("reformer.prefill.slices")),
                           str(a.get("reformer.prefill.slices_total_s")),
                           str(a.get("reformer.prefill.slice_longest_s")), str(row["prefill_events"]))
    console.print(long_table)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prompts = Prompts(args.data or [REPO / "corpus" / "data", REPO / "corpus" / "corpus"])
    lengths = [int(x) for x in args.span_lengths.split(",") if x.strip()]
    args.logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    argv_server = service_argv(args.artifact, "--log-level", "info", "--log-json")
    with OtlpReceiver() as receiver:
        with ServerProcess(argv_server, log_path=args.logs / "off.log", env=server_env(None)) as off, \
                ServerProcess(argv_server, log_path=args.logs / "on.log", env=server_env(receiver.url)) as on:
            off.wait_ready()
            on.wait_ready()
            servers = {"off": off, "on": on}
            rounds = measure_rounds(servers, prompts, args)
            long_prompts = long_prompt_traces(on.url, receiver, prompts, lengths)
            on.stop()  # SIGTERM: its tracing flushes, then logs what it ended and exported
        load_after = os.getloadavg()
        on_rounds = args.warmup_rounds + sum(1 for r in rounds if r["server"] == "on")
        sent_to_on: Counter[str] = Counter()
        for i in range(args.requests):
            sent_to_on[f"POST {plan(i, prompts, args.long_every, 256).path}"] += on_rounds  # paths only
        sent_to_on["POST /generate"] += len(lengths)
        spans = span_report(receiver, sent_to_on, tracing_counts(args.logs / "on.log"))
    report = {
        "command": " ".join(["python", "bench/serving/tracing_overhead.py", *(argv or sys.argv[1:])]),
        "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": load_before, "load_after": load_after, "settings": SETTINGS,
        "requests_per_round": args.requests, "warmup_rounds": args.warmup_rounds, "clients": args.clients,
        "long_every": args.long_every,
        "books": prompts.sources, "rounds": rounds, "summary": summarize(rounds), "spans": spans,
        "long_prompts": long_prompts,
    }
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    failed = [r for r in rounds if set(r["outcomes"]) - {OK}]
    return 0 if not failed and spans["lost"] == 0 and spans["every_request_has_its_span"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
