"""REFORMER_PREFILL=causal against one-piece, through the service in-process, on the shipped model: the time to
first token of a cold prompt (a document of `--chars` characters of a test-set book and a question), of a second
question about the same document (no declaration: the causal server finds the document's blocks by content;
the one-piece server prefills again), of a repeat of the first prompt, of a 1,000-character question about the
document, and of a conversation's next turn (the first prompt, its answer and a new message). Ratios are taken
in one run, against the one-piece server's cold first prompt.

    python bench/prefill/causal_prefill.py [ARTIFACT] --test-books DIR [--chars 8000] [--out FILE]

Each server answers greedily with max_new_tokens 1, so the request's time is its time to first token. The
document is the first `--chars` characters of the first whole book of --test-books (bench/unseen_books.py). Writes
bench/results/causal_prefill_<date>.json and prints a table with the 1-minute load before and after."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.unseen_books import add_test_books_arg, whole_books  # noqa: E402
from export import load_artifact  # noqa: E402
from tests.service.helpers import running_app  # noqa: E402

QUESTIONS = [" Who speaks first in this passage, and to whom?", " What is the weather like?"]
LONG_QUESTION = " Read the passage again and answer in detail: " + "who said what to whom, and why, in order? " * 22
NEXT_TURN = "\nUser: And what happens after that?\nAssistant:"


def _ask(client: Any, prompt: str) -> tuple[float, str, int]:
    began = time.perf_counter()
    r = client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 1, "details": True}})
    elapsed = time.perf_counter() - began
    r.raise_for_status()
    body = r.json()
    return elapsed, body["generated_text"], body["details"]["cached_tokens"]


def run(artifact: Any, doc: str, prefill: str) -> dict[str, Any]:
    settings = dict(prefill=prefill, max_input_tokens=len(doc.encode()) + 4096, warmup=True)
    with running_app(artifact, **settings) as client:
        first = _ask(client, doc + QUESTIONS[0])
        second = _ask(client, doc + QUESTIONS[1])
        repeat = _ask(client, doc + QUESTIONS[0])
        long = _ask(client, doc + LONG_QUESTION)
        turn = _ask(client, doc + QUESTIONS[0] + first[1] + NEXT_TURN)
    asked = (("first", first), ("second", second), ("repeat", repeat), ("long_question", long), ("next_turn", turn))
    return {name: {"seconds": t, "text": text, "cached_tokens": cached} for name, (t, text, cached) in asked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", nargs="?", default=str(REPO / "export" / "default_artifact"))
    ap.add_argument("--chars", type=int, default=8000)
    add_test_books_arg(ap)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.test_books is None:
        raise SystemExit("--test-books DIR: the test set's books")
    artifact = load_artifact(Path(args.artifact))
    name, ids = whole_books(args.test_books, artifact.tokenizer)[0]
    doc = artifact.tokenizer.decode([int(i) for i in ids])[: args.chars]
    load_before = os.getloadavg()[0]
    results = {mode: run(artifact, doc, mode) for mode in ("one-piece", "causal")}
    load_after = os.getloadavg()[0]
    cold = results["one-piece"]["first"]["seconds"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    out = {"artifact": args.artifact, "book": name, "chars": len(doc), "commit": commit,
           "load_1min_before": load_before, "load_1min_after": load_after, "results": results,
           "ratios_to_one_piece_cold": {f"{mode}.{name}": r["seconds"] / cold
                                        for mode, rs in results.items() for name, r in rs.items()}}
    path = args.out or REPO / "bench" / "results" / f"causal_prefill_{datetime.date.today()}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"load before {load_before:.2f}, after {load_after:.2f}; {len(doc)} characters of {name}")
    print(f"{'prefill':<10} {'request':<14} {'TTFT s':>8} {'x one-piece cold':>17} {'cached':>7}")
    for mode, rs in results.items():
        for name, r in rs.items():
            print(f"{mode:<10} {name:<14} {r['seconds']:>8.3f} {r['seconds'] / cold:>17.3f} {r['cached_tokens']:>7}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
