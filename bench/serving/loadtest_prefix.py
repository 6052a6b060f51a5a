"""`reformer loadtest --questions-per-doc K` against the served model, the prefix cache on against off.

    python bench/serving/loadtest_prefix.py [ARTIFACT] --docs DIR [--length 16384] [--questions 8]
        [--documents 3] [--max-new-tokens 4] [--causal] [--at-once] [--out bench/results/loadtest_prefix_16k.json.gz]

Three load tests of the same shape (one client, --documents documents of --length bytes, each asked
--questions different questions over `/generate_stream`, one after the other or, with --at-once, all at the same
time (`--questions-at-once`), one warm-up document), each its own run of
`python -m loadtest.cli` whose command line the JSON records:
1. `on`: a server with the one-piece prefill (REFORMER_PREFILL=one-piece; the prefix cache on), each request
   declaring its document with `cache_prefix_chars`;
2. `on_undeclared`: the same server, the same prompts without the declaration (`--no-cache-prefix`);
3. `off`: a server started with REFORMER_PREFIX_CACHE=false (and the one-piece prefill), the prompts declared as
   in 1;
4. with `--causal`, `causal`: a server started with REFORMER_PREFILL=causal, the prompts undeclared (the causal
   prefill finds a document's blocks by content), judged by its own targets (CAUSAL_* below) against `off`.
The shipped model unless ARTIFACT (one token a byte). Writes the three reports, the ratios of mean TTFT
(off / on, on_undeclared / on) and the 1-minute load before and after; prints a table. Run it alone
(bench/quiet_run.sh): the two cores are the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.results_io import write_json  # noqa: E402
from bench.server_process import ServerProcess, service_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HIT_RATE_TARGET = 0.85  # of the prompt tokens the declared runs send, restored
TTFT_TARGET = 5.0  # mean TTFT with the cache off over mean TTFT with it on
CAUSAL_SAVED_TARGET = 0.90  # of the prompt tokens the causal run sends, restored (issue 62)
CAUSAL_TTFT_TARGET = 8.0  # mean TTFT with the cache off over the causal run's


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path, nargs="?", default=None)
    p.add_argument("--docs", type=Path, required=True, help="a folder of books (reformer loadtest --docs)")
    p.add_argument("--length", type=int, default=16384, help="document length in bytes (tokens, bytes model)")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--documents", type=int, default=3, help="measured documents per run")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/loadtest_prefix_16k.json.gz",
                   help="the result with every run's report, gzip-compressed when the name ends in .gz")
    p.add_argument("--logs", type=Path, default=Path("/tmp/loadtest_prefix_logs"))
    p.add_argument("--causal", action="store_true", help="also run the causal prefill's server, undeclared")
    p.add_argument("--at-once", action="store_true", help="send a document's questions at the same time")
    return p


def _server(artifact: Path | None, logs: Path, name: str, **env: str) -> ServerProcess:
    logs.mkdir(parents=True, exist_ok=True)
    environ = {**os.environ, "REFORMER_LOG_LEVEL": "warning",
               **{f"REFORMER_{k.upper()}": v for k, v in env.items()}}
    proc = ServerProcess(service_argv(artifact), log_path=logs / f"{name}.log", env=environ)
    proc.wait_ready(300)
    return proc


def _loadtest(args: argparse.Namespace, url: str, name: str, *extra: str) -> dict[str, Any]:
    out = args.logs / f"{name}.json"
    argv = [sys.executable, "-m", "loadtest.cli", "--url", url, "--docs", str(args.docs),
            "--lengths", str(args.length), "--concurrency", "1",
            "--requests", str(args.documents * args.questions), "--questions-per-doc", str(args.questions),
            "--endpoint", "stream", "--max-new-tokens", str(args.max_new_tokens), "--warmup", "1",
            "--docs-per-length", str(args.documents + 1), "--timeout", "1800", "--strict",
            "--out", str(out), *(["--questions-at-once"] if args.at_once else []), *extra]
    began = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True)
    report: dict[str, Any] = json.loads(out.read_text())
    shown = ["reformer", "loadtest", *argv[3:]]
    shown[shown.index("--url") + 1] = "URL"
    shown[shown.index("--out") + 1] = f"{name}.json"
    return {"command": " ".join(shown), "wall_s": time.perf_counter() - began, "report": report}


def _questions(run: dict[str, Any]) -> dict[str, Any]:
    (row,) = run["report"]["results"]
    q: dict[str, Any] = row["questions"]
    return q


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result: dict[str, Any] = {
        "command": "python bench/serving/loadtest_prefix.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": commit.stdout.strip(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_before": os.getloadavg()[0],
        "runs": {},
    }
    with _server(args.artifact, args.logs, "on", prefill="one-piece") as on:
        result["runs"]["on"] = _loadtest(args, on.url, "on")
        result["runs"]["on_undeclared"] = _loadtest(args, on.url, "on_undeclared", "--no-cache-prefix")
    with _server(args.artifact, args.logs, "off", prefix_cache="false", prefill="one-piece") as off:
        result["runs"]["off"] = _loadtest(args, off.url, "off")
    if args.causal:
        with _server(args.artifact, args.logs, "causal", prefill="causal") as causal:
            result["runs"]["causal"] = _loadtest(args, causal.url, "causal", "--no-cache-prefix")
    result["load_after"] = os.getloadavg()[0]
    q = {name: _questions(run) for name, run in result["runs"].items()}
    mean = {name: qq["all"]["ttft_s"]["mean"] for name, qq in q.items()}
    result["summary"] = {
        "hit_rate": q["on"]["hit_rate"],
        "saved_fraction": q["on"]["saved_fraction"],
        "saved_prefill_tokens": q["on"]["saved_prefill_tokens"],
        "ttft_mean_s": mean,
        "ttft_off_over_on": mean["off"] / mean["on"],
        "ttft_undeclared_over_on": mean["on_undeclared"] / mean["on"],
        "targets": {
            f"saved_fraction >= {HIT_RATE_TARGET}": (q["on"]["saved_fraction"] or 0) >= HIT_RATE_TARGET,
            f"ttft_off_over_on >= {TTFT_TARGET}": mean["off"] / mean["on"] >= TTFT_TARGET,
        },
    }
    if args.causal:
        result["summary"]["causal_saved_fraction"] = q["causal"]["saved_fraction"]
        result["summary"]["ttft_off_over_causal"] = mean["off"] / mean["causal"]
        result["summary"]["targets"].update({
            f"causal saved_fraction >= {CAUSAL_SAVED_TARGET}": (q["causal"]["saved_fraction"] or 0)
            >= CAUSAL_SAVED_TARGET,
            f"ttft_off_over_causal >= {CAUSAL_TTFT_TARGET}": mean["off"] / mean["causal"] >= CAUSAL_TTFT_TARGET})
    write_json(args.out, result)
    print(f"commit {result['commit']}; load {result['load_before']:.2f} before, {result['load_after']:.2f} after; "
          f"{args.documents} documents of {args.length} bytes x {args.questions} questions")
    print("| run | hit rate (server) | prefill saved | TTFT first mean s | TTFT later mean s | TTFT all mean s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, qq in q.items():
        rate = "-" if qq["hit_rate"] is None else f"{100 * qq['hit_rate']:.1f}%"
        saved = f"{qq['saved_prefill_tokens']} ({100 * (qq['saved_fraction'] or 0):.1f}%)"
        later = qq["later"]["ttft_s"]["mean"] if qq["later"]["ttft_s"] else float("nan")
        print(f"| {name} | {rate} | {saved} | {qq['first']['ttft_s']['mean']:.3f} | {later:.3f} | {mean[name]:.3f} |")
    s = result["summary"]
    print(f"mean TTFT off / on: {s['ttft_off_over_on']:.2f}x; undeclared / on: {s['ttft_undeclared_over_on']:.2f}x")
    if args.causal:
        print(f"mean TTFT off / causal (undeclared): {s['ttft_off_over_causal']:.2f}x")
    for target, met in s["targets"].items():
        print(f"target {target}: {'met' if met else 'NOT met'}")
    return result


if __name__ == "__main__":
    main()
