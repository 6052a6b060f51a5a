"""Cold prefill speed of the exact extend (model/decoding/extend.py: a prompt fed as one extend from an empty
request, leaving what one decode step per token leaves) against today's one-piece prefill (model/decoding/
prefill/, the anchor), in one process, calls alternating.

    python bench/prefill/extend_cost.py --book BOOK.txt [--lengths 4096,16384,65536] [--reps 3] [--threads 2]
                                        [--steps-up-to 4096] [--out PATH]

Each length L: L bytes of the book (a held-out one, from the test set: never trained on; the shipped model's
tokenizer is byte-level, so L tokens) at a different offset each rep, through `prefill` on a fresh request and
through `Decoder.extend` on a fresh empty request of the same cache, in turns (which goes first alternates);
up to --steps-up-to tokens also through one decode step per token (what a prompt's tokens after a declared
prefix cost today, and what extend replaces with the same results), on one thread as the service runs a
one-row step. The table gives each one's median
tokens/s and the ratios (extend over the other: above 1, extend is faster), and the machine's 1-minute load
before and after; compare ratios, not absolute times across runs (the machine's speed moves between runs).
Writes bench/results/extend_cost_<date>_<commit>.json by default.

What extend costs and why (extend_layers.c): its dense work is batched over the rows; every row attends its own
decode window (2 x 64 keys per round and head in an LSH layer, 128 positions in a local one), with the
arithmetic a decode step uses for it, but the windows are shared between rows: an LSH layer's rows (blocks of
1,024) are taken per head and round in the order of their windows, so rows whose windows overlap read the same
key and value rows from cache (the one-piece prefill shares one window between a chunk's 64 queries), and a
local layer's rows read one contiguous copy of the positions they cover. On two threads each takes half the
heads of every row; the products, hashes, layer norms and tails are split by columns or rows, with a few
barriers per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from export import load_artifact  # noqa: E402
from model.decoding import DecodeCache, Decoder, prefill, step_threads  # noqa: E402
from model.decoding.extend import c_path, open_indexes  # noqa: E402
from model.decoding.runtime import tune_cpu_runtime  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,16384", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps-up-to", type=int, default=4096,
                   help="also time one decode step per token (what extend replaces) up to this length")
    p.add_argument("--book", type=Path, required=True, help="a UTF-8 text of at least twice the longest length")
    p.add_argument("--out", type=Path, default=None,
                   help="default: bench/results/extend_cost_<date>_<commit>.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_cpu_runtime()  # as `reformer serve` runs
    lengths = [int(v) for v in args.lengths.split(",")]
    artifact = load_artifact()
    lm, tok = artifact.model.eval(), artifact.tokenizer
    text = args.book.read_bytes().decode("utf-8", "ignore")
    # sized as the service sizes its cache (service/engine/runner.py): recent orders of recent_size_for(max_tokens)
    cache = DecodeCache(lm, 2**31, 2, max_tokens=max(lengths))
    decoder = Decoder(lm, cache)
    if not c_path(decoder):
        raise SystemExit("the C extend does not run here (no kernels, or automatic bucket counts)")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    load_before = [round(v, 2) for v in os.getloadavg()]
    rows = []
    for length in lengths:
        ways = ["prefill", "extend"] + (["steps"] if length <= args.steps_up_to else [])
        times: dict[str, list[float]] = {name: [] for name in ways}
        for rep in range(args.reps):
            start = (rep * 7919 * 13) % max(len(text) - 2 * length, 1)
            ids = tok.encode(text[start : start + 2 * length])[:length]
            assert len(ids) == length, f"the book is too short for {length} tokens"
            for name in (ways if rep % 2 == 0 else ways[::-1]):
                with torch.inference_mode():
                    if name == "prefill":
                        t0 = time.perf_counter()
                        _, states = prefill(lm, cache, [torch.tensor(ids)], [length])
                        times[name].append(time.perf_counter() - t0)
                        state = states[0]
                    elif name == "extend":
                        state = cache.allocate(length)
                        t0 = time.perf_counter()
                        decoder.extend(state, ids)
                        times[name].append(time.perf_counter() - t0)
                    else:
                        state = cache.allocate(length)
                        t0 = time.perf_counter()
                        open_indexes(decoder, state)
                        with step_threads(1):  # as the service runs a one-row step (model/decoding/threads.py)
                            for token in ids:
                                decoder.step([token], [state])
                        times[name].append(time.perf_counter() - t0)
                cache.free(state)
        prefill_s, extend_s = statistics.median(times["prefill"]), statistics.median(times["extend"])
        rows.append({"tokens": length, "reps": args.reps, "prefill_s": [round(t, 4) for t in times["prefill"]],
                     "extend_s": [round(t, 4) for t in times["extend"]],
                     "prefill_tokens_per_s": round(length / prefill_s), "extend_tokens_per_s": round(length / extend_s),
                     "extend_over_prefill": round(prefill_s / extend_s, 3)})
        if "steps" in times:
            steps_s = statistics.median(times["steps"])
            rows[-1].update(steps_s=[round(t, 4) for t in times["steps"]], steps_tokens_per_s=round(length / steps_s),
                            extend_over_steps=round(steps_s / extend_s, 3))
    out = {"benchmark": "extend_cost", "commit": commit, "artifact": "export/default_artifact",
           "book": args.book.name, "threads": args.threads, "rows": rows,
           "recent_size": next((index.recent_size for index in cache.indexes if index is not None), None),
           "load_before": load_before,
           "load_after": [round(v, 2) for v in os.getloadavg()]}
    path = args.out or ROOT / "bench" / "results" / f"extend_cost_{time.strftime('%Y-%m-%d')}_{commit}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"cold prefill of the shipped model, median tokens/s, {args.threads} thread(s), {args.reps} reps")
    print(f"{'tokens':>8}{'one-piece':>12}{'extend':>10}{'extend/one-piece':>18}{'steps':>8}{'extend/steps':>14}")
    for r in rows:
        steps = (f"{r['steps_tokens_per_s']:>8}{r['extend_over_steps']:>14.3f}" if "steps_s" in r
                 else f"{'-':>8}{'-':>14}")
        print(f"{r['tokens']:>8}{r['prefill_tokens_per_s']:>12}{r['extend_tokens_per_s']:>10}"
              f"{r['extend_over_prefill']:>18.3f}{steps}")
    print(f"1-minute load before {load_before[0]}, after {out['load_after'][0]}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
