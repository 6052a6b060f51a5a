"""A half-million-token document asked twice (issue 62): `reformer serve` on an artifact of
google/reformer-crime-and-punishment's configuration (524,288 positions; bench/import_hf/import_hf_crime.py writes one
with random weights), a document of --tokens tokens and a question, then the same document and another
question, under REFORMER_PREFILL=one-piece and =causal, one server per mode.

    python bench/serving/causal_500k.py ARTIFACT --book BOOK.txt [--tokens 500000] [--modes one-piece,causal]
        [--cache-bytes 6442450944] [--prefix-cache-bytes 4294967296] [--out bench/results/causal_500k.json]

Each request is a `/generate` of one greedy token with details, so its wall time is its time to first token;
`details.cached_tokens` says how much of the prompt came from the prefix cache. The one-piece server keeps no
undeclared prefix, so its second question is a second cold prefill; the causal server finds the document's
blocks by content and reads only the rest. Ratios are taken in one run: the causal cold prefill's tokens/s over
the one-piece one's (target: at least 0.8 at 500K), and the second question's time (target: at most 1 s from
memory). Run it alone (bench/quiet_run.sh): the two cores are the measurement. Writes the JSON and prints a
table with the 1-minute load before and after.
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

if __package__ in (None, ""):  # run as a script: the tree's packages are importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from bench.server_process import ServerProcess, service_argv  # noqa: E402
from bench.serving.long_prompt_500k import prompt_texts  # noqa: E402
from export import load_artifact  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ("\nQuestion: who speaks first in this passage, and to whom?\nAnswer:",
             "\nQuestion: what is the weather like in the last chapter?\nAnswer:")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--book", type=Path, required=True, help="plain text the document is cut from (repeated if short)")
    p.add_argument("--tokens", type=int, default=500_000, help="the document's length in the artifact's tokens")
    p.add_argument("--modes", default="one-piece,causal")
    p.add_argument("--cache-bytes", type=int, default=6 * 2**30)
    p.add_argument("--prefix-cache-bytes", type=int, default=4 * 2**30)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one request may take")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/causal_500k.json")
    p.add_argument("--logs", type=Path, default=Path("/tmp/causal_500k_logs"), help="the servers' logs")
    return p


def ask(url: str, prompt: str, timeout: float) -> dict[str, Any]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 1, "details": True}}
    sent = time.perf_counter()
    r = httpx.post(f"{url}/generate", json=body, timeout=timeout)
    seconds = time.perf_counter() - sent
    r.raise_for_status()
    out = r.json()
    return {"seconds": round(seconds, 3), "text": out["generated_text"],
            "cached_tokens": out["details"].get("cached_tokens"), "prompt_tokens": out["details"].get("prompt_tokens")}


def run_mode(args: argparse.Namespace, mode: str, doc: str) -> dict[str, Any]:
    env = dict(os.environ, REFORMER_PREFILL=mode, REFORMER_CACHE_BYTES=str(args.cache_bytes),
               REFORMER_PREFIX_CACHE_BYTES=str(args.prefix_cache_bytes), REFORMER_MAX_BATCH_SIZE="2",
               REFORMER_REQUEST_TIMEOUT_S="3600")
    args.logs.mkdir(parents=True, exist_ok=True)
    with ServerProcess.ready(service_argv(args.artifact), log_path=args.logs / f"{mode}.log", env=env) as server:
        first = ask(server.url, doc + QUESTIONS[0], args.timeout)
        second = ask(server.url, doc + QUESTIONS[1], args.timeout)
        return {"first": first, "second": second, "peak_rss_mb": server.peak_rss_mb()}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tokenizer = load_artifact(args.artifact).tokenizer
    doc, doc_tokens = prompt_texts(tokenizer, args.book, [args.tokens])[args.tokens]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    load_before = [round(v, 2) for v in os.getloadavg()]
    modes = {mode: run_mode(args, mode, doc) for mode in args.modes.split(",")}
    out: dict[str, Any] = {"benchmark": "causal_500k", "commit": commit, "artifact": str(args.artifact),
                           "book": args.book.name, "document_tokens": doc_tokens, "cache_bytes": args.cache_bytes,
                           "prefix_cache_bytes": args.prefix_cache_bytes, "modes": modes,
                           "load_before": load_before, "load_after": [round(v, 2) for v in os.getloadavg()]}
    if "one-piece" in modes and "causal" in modes:
        out["causal_cold_over_one_piece_tokens_per_s"] = round(
            modes["one-piece"]["first"]["seconds"] / modes["causal"]["first"]["seconds"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"a {doc_tokens}-token document and a question, then another question (/generate, 1 token)")
    print(f"{'mode':>10}{'first s':>10}{'tokens/s':>10}{'second s':>10}{'cached':>9}{'peak RSS MB':>13}")
    for mode, r in modes.items():
        first, second = r["first"], r["second"]
        print(f"{mode:>10}{first['seconds']:>10.2f}{first['prompt_tokens'] / first['seconds']:>10.0f}"
              f"{second['seconds']:>10.3f}{second['cached_tokens']:>9}{r['peak_rss_mb']:>13.0f}")
    if "causal_cold_over_one_piece_tokens_per_s" in out:
        print(f"causal cold prefill / one-piece, tokens/s: {out['causal_cold_over_one_piece_tokens_per_s']:.3f}")
    print(f"1-minute load before {load_before[0]}, after {out['load_after'][0]}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
