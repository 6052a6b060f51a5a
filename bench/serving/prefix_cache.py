"""The prefix cache through the service: time to first token of a second question about the same document
(against the first's), of `n` choices against one, and of cold prompts with the cache on against off.

    python bench/serving/prefix_cache.py [ARTIFACT] --book BOOK.txt [--doc-bytes 60000] [--questions 4]
        [--n-tokens 16384] [--cold-lengths 16384,65536] [--repeats 3] [--cache-dir DIR] [--off-questions 2]
        [--env NAME=VALUE ...] [--out bench/results/prefix_cache.json]

One server per setting (python -m service, the shipped model unless ARTIFACT), one request at a time, each a
streamed `/generate_stream` of 4 greedy tokens; TTFT is request sent -> first event. Phases:
1. `doc`: a --doc-bytes (characters) document cut from BOOK, then --questions different questions about it, each with
   `cache_prefix_chars` = the document's length: the first prefills the document, the rest restore it. The
   same requests on a server with the prefix cache off (every question prefills), and each whole prompt
   without the field (today's one-piece prefill, the anchor).
2. `restart` (with --cache-dir): a server restarted on the same disk tier answers one more question: its
   TTFT, restored from disk.
3. `n`: a --n-tokens prompt asked with n=4 (sampled, seeded) against n=1 on /v1/completions, one token each,
   non-streaming: wall time (its time to first token), and the decode cache's allocated bytes
   (reformer_decode_cache_bytes) read while it runs.
4. `cold`: prompts of --cold-lengths tokens, each new (no hit), on a server with the memory tier only and one
   with the cache off, both running, one request to each in turn (2 x --repeats each): TTFT (what keeping a
   state costs a first token).
--n-tokens 0 and an empty --cold-lengths skip phases 3 and 4 (a 500K-token document: --doc-bytes in
characters, the tokenizer's count reported as cached_tokens). Every figure is the median of --repeats. Writes
the JSON and prints a table with the load. Run it alone (bench/quiet_run.sh): the two cores are the
measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from bench.server_process import ServerProcess, service_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["\n\nQuestion: who is the first person named above?\nAnswer:",
             "\n\nQuestion: where does the passage take place?\nAnswer:",
             "\n\nQuestion: what happens at the end of the passage?\nAnswer:",
             "\n\nQuestion: name one object mentioned above.\nAnswer:",
             "\n\nQuestion: what season is it?\nAnswer:",
             "\n\nQuestion: who speaks last?\nAnswer:"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path, nargs="?", default=None)
    p.add_argument("--book", type=Path, required=True, help="plain text (bytes model: one token a byte)")
    p.add_argument("--doc-bytes", type=int, default=60000)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--n-tokens", type=int, default=16384)
    p.add_argument("--cold-lengths", default="16384,65536")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-dir", type=Path, default=None, help="a disk tier folder (emptied first)")
    p.add_argument("--off-questions", type=int, default=2, help="questions asked of the cache-off server")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="a REFORMER_ setting for every server, e.g. CACHE_BYTES=4294967296 (repeatable)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/prefix_cache.json")
    p.add_argument("--logs", type=Path, default=Path("/tmp/prefix_cache_logs"))
    return p


def ttft(url: str, text: str, chars: int | None = None) -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached tokens the last event reports."""
    params: dict[str, Any] = {"max_new_tokens": 4, "details": True}
    if chars is not None:
        params["cache_prefix_chars"] = chars
    began = time.perf_counter()
    first = None
    cached = -1
    with httpx.stream("POST", url + "/generate_stream", json={"inputs": text, "parameters": params},
                      timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            if first is None:
                first = time.perf_counter() - began
            event = json.loads(line[5:])
            if event.get("details"):
                cached = event["details"].get("cached_tokens", 0)
    assert first is not None
    return first, cached


SETTINGS: dict[str, str] = {}  # --env, for every server


def server(artifact: Path | None, logs: Path, name: str, **env: str) -> ServerProcess:
    logs.mkdir(parents=True, exist_ok=True)
    environ = {**os.environ, "REFORMER_MAX_NEW_TOKENS": "64", "REFORMER_LOG_LEVEL": "warning", **SETTINGS,
               **{f"REFORMER_{k.upper()}": v for k, v in env.items()}}
    proc = ServerProcess(service_argv(artifact), log_path=logs / f"{name}.log", env=environ)
    proc.wait_ready(300)
    return proc


def cache_bytes(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('reformer_decode_cache_bytes{state="allocated"}'):
            return float(line.split()[-1])
    return 0.0


def doc_phase(url: str, doc: str, questions: list[str], repeats: int, declare: bool) -> list[dict[str, Any]]:
    rows = []
    for i, q in enumerate(questions):
        runs = [ttft(url, doc + q + " " * r, len(doc) if declare else None) for r in range(repeats)]
        rows.append({"question": i, "ttft_s": statistics.median(t for t, _ in runs),
                     "cached_tokens": runs[-1][1]})
    return rows


def _watch_peak(url: str, peak: list[float], done: threading.Event) -> None:
    """The most decode-cache bytes allocated, polled from /metrics until `done`."""
    while not done.is_set():
        peak[0] = max(peak[0], cache_bytes(url))
        time.sleep(0.05)


def n_phase(url: str, prompt: str, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in (1, 4):
        walls, peaks = [], []
        for r in range(repeats):
            peak = [0.0]
            done = threading.Event()
            watcher = threading.Thread(target=_watch_peak, args=(url, peak, done))
            watcher.start()
            began = time.perf_counter()
            # one token: the answer's time is its time to first token (a stream cannot carry n > 1)
            resp = httpx.post(url + "/v1/completions", json={"prompt": prompt + f" #{n}.{r}", "max_tokens": 1, "n": n,
                                                            "temperature": 0.8, "seed": r}, timeout=1800)
            walls.append(time.perf_counter() - began)
            done.set()
            watcher.join()
            resp.raise_for_status()
            peaks.append(peak[0])
        out[f"n{n}"] = {"wall_s": statistics.median(walls), "peak_decode_cache_bytes": max(peaks)}
    out["wall_ratio"] = out["n4"]["wall_s"] / out["n1"]["wall_s"]
    out["memory_ratio"] = out["n4"]["peak_decode_cache_bytes"] / max(out["n1"]["peak_decode_cache_bytes"], 1.0)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    SETTINGS.update({f"REFORMER_{k.upper()}": v for k, v in (e.split("=", 1) for e in args.env)})
    cold_lengths = [int(x) for x in args.cold_lengths.split(",") if x.strip()]
    text = args.book.read_text(encoding="utf-8", errors="replace").encode("utf-8", "ignore").decode("ascii", "ignore")
    while len(text) < max(args.doc_bytes, args.n_tokens, *cold_lengths) + 10:
        text += "\n" + text
    doc = text[: args.doc_bytes]
    questions = QUESTIONS[: args.questions]
    load = os.getloadavg()[0]
    result: dict[str, Any] = {"load_before": load, "doc_bytes": len(doc), "book": args.book.name,
                              "settings": SETTINGS, "artifact": str(args.artifact or "shipped")}
    disk = {"prefix_cache_dir": str(args.cache_dir)} if args.cache_dir else {}
    if args.cache_dir:
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        for f in args.cache_dir.glob("*.safetensors"):
            f.unlink()
    with server(args.artifact, args.logs, "on", **disk) as on:
        result["doc_cache_on"] = doc_phase(on.url, doc, questions, 1, declare=True)
        if args.n_tokens:
            result["n"] = n_phase(on.url, text[: args.n_tokens], args.repeats)
    if cold_lengths:  # the memory tier only (no disk writes), against the cache off, request by request in turn
        with server(args.artifact, args.logs, "cold") as cold, \
                server(args.artifact, args.logs, "cold_off", prefix_cache="false") as cold_off:
            runs: dict[str, dict[int, list[float]]] = {"cold_on": {}, "cold_off": {}}
            for n in cold_lengths:
                for i in range(1, 2 * args.repeats + 1):
                    runs["cold_on"].setdefault(n, []).append(ttft(cold.url, text[i * 7 : i * 7 + n])[0])
                    runs["cold_off"].setdefault(n, []).append(ttft(cold_off.url, text[i * 7 + 3 : i * 7 + 3 + n])[0])
            result["cold_runs"] = runs
            for name, by_length in runs.items():
                result[name] = {n: statistics.median(times) for n, times in by_length.items()}
    if args.cache_dir:
        with server(args.artifact, args.logs, "restart", **disk) as again:
            t, cached = ttft(again.url, doc + QUESTIONS[-1], len(doc))
            result["restart"] = {"ttft_s": t, "cached_tokens": cached}
    with server(args.artifact, args.logs, "off", prefix_cache="false") as off:
        result["doc_cache_off"] = doc_phase(off.url, doc, questions[: args.off_questions], 1, declare=True)
        result["doc_whole_prompt"] = doc_phase(off.url, doc, questions[: args.off_questions], 1, declare=False)
    first = result["doc_cache_on"][0]["ttft_s"]
    later = [row["ttft_s"] for row in result["doc_cache_on"][1:]]
    anchor = statistics.median(row["ttft_s"] for row in result["doc_whole_prompt"])
    result["second_question_ratio"] = statistics.median(later) / first
    result["second_question_vs_whole_prompt"] = statistics.median(later) / anchor
    result["cold_speed_ratio"] = {n: result["cold_off"][n] / result["cold_on"][n] for n in result.get("cold_on", {})}
    result["load_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load {load:.2f} before, {result['load_after']:.2f} after; document {len(doc)} characters, "
          f"{result['doc_cache_on'][-1]['cached_tokens']} tokens")
    print("| measure | value |\n|---|---|")
    print(f"| first question TTFT (prefills the document) | {first:.3f} s |")
    print(f"| later questions TTFT (median, restored) | {statistics.median(later):.3f} s |")
    print(f"| later / first | {result['second_question_ratio']:.3f}x |")
    print(f"| whole prompt, no cache_prefix_chars (today's prefill) | {anchor:.3f} s |")
    print(f"| later / whole prompt | {result['second_question_vs_whole_prompt']:.3f}x |")
    if "restart" in result:
        print(f"| after a restart, from disk | {result['restart']['ttft_s']:.3f} s "
              f"({result['restart']['cached_tokens']} cached) |")
    if "n" in result:
        n = result["n"]
        print(f"| n=4 / n=1 time to the first token at {args.n_tokens} tokens | {n['wall_ratio']:.2f}x |")
        print(f"| n=4 / n=1 peak decode-cache bytes | {n['memory_ratio']:.2f}x |")
    for length, ratio in result["cold_speed_ratio"].items():
        print(f"| cold prompt of {length} tokens, speed with cache / without | {ratio:.3f}x |")
    return result


if __name__ == "__main__":
    main()
