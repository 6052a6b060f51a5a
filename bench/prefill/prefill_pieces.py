"""Every piece of a long prompt's sliced prefill timed and labelled (issue 34, item 4): which whole-prompt
pieces are left longer than the engine's prefill budget allows between two decode steps.

    python bench/prefill/prefill_pieces.py [MODEL] [--data corpus/data] [--long-bytes 60000] [--threads 1]
                                   [--runs 3] [--top 15] [--sort wall|cpu] [--out PATH]

MODEL is an artifact directory (default: the shipped export/default_artifact). The prompt is the same
`--long-bytes` bytes of a book as bench/prefill/prefill_gap.py's long prompt; it is prefilled through
`model.decoding.prefill_steps` into the cache the service's `ModelRunner` builds, under the service's process
settings (`service.api.server.apply_process_settings`) and inference mode, on `--threads` intra-op threads, with
nothing else running: once to warm up (the pool's pages fault in, kernels load), then `--runs` times timed.

A piece is the work between two `yield`s of the generator (what the engine runs as one slice). Each is
labelled by the yields it runs between: the innermost generator's function and line where the previous piece
stopped and where this one stops (the delegation chain of `yield from` walked down), and the layer it is in.
Prints the `--top` longest pieces (median over the runs, the longest run, and the median CPU time of the
thread, which a busy machine inflates less, and the most minor page faults of a run) and the time per label.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.results_io import write_json  # noqa: E402
from export import load_artifact  # noqa: E402
from model.decoding import prefill_steps  # noqa: E402
from service.api.server import apply_process_settings  # noqa: E402
from service.engine.runner import ModelRunner  # noqa: E402
from train.corpus_manifest import set_folder  # noqa: E402

BOOK = "war_and_peace_pg2600.txt"  # bench/prefill/prefill_gap.py's long prompt: these bytes from offset 200,000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="artifact directory (default: the shipped one)")
    p.add_argument("--data", type=Path, default=set_folder("data"),
                   help="folder of books (default: corpus/data, written by `reformer data`)")
    p.add_argument("--long-bytes", type=int, default=60_000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--sort", choices=("wall", "cpu"), default="wall",
                   help="order by the median wall time, or by the CPU time (steadier on a busy machine)")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the table as JSON (gzip-compressed when the name ends in .gz)")
    return p


# generators that only cut a caller's product into blocks (model/decoding/prefill/row_blocks.py, slices.py): a
# piece inside them is named by the caller's line, which tells which product it is
_BLOCK_HELPERS = ("in_blocks", "project")


def where(gen: Generator[Any, Any, Any]) -> tuple[str, int | None]:
    """Where a suspended generator stopped: 'function:line' of the innermost generator of its `yield from`
    chain (of its caller, marked '[block]', when that is a block helper), and the layer index `li` of the
    prefill's layer loop if it is inside one."""
    layer = None
    frames = []
    inner: Any = gen
    while inner is not None and getattr(inner, "gi_frame", None) is not None:
        frame = inner.gi_frame
        frames.append(frame)
        if frame.f_code.co_name == "_prefill_layers" and "li" in frame.f_locals:
            layer = int(frame.f_locals["li"])
        inner = inner.gi_yieldfrom
    if not frames:
        return "end", layer
    blocks = [f for f in frames if f.f_code.co_name not in _BLOCK_HELPERS]
    if frames[-1].f_code.co_name in _BLOCK_HELPERS and blocks:
        return f"{blocks[-1].f_code.co_name}:{blocks[-1].f_lineno}[block]", layer
    return f"{frames[-1].f_code.co_name}:{frames[-1].f_lineno}", layer


def _faults() -> int:
    """This thread's minor page faults so far (a first touch of fresh memory: a large new tensor)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def timed_pieces(runner: ModelRunner, ids: list[int]) -> list[tuple[str, float, float, int]]:
    """One sliced prefill of `ids`: each piece's label, wall seconds, this thread's CPU seconds (all of the
    piece's on one intra-op thread; less than the wall time by what other processes took) and its minor page
    faults, in order; frees its cache after."""
    with torch.inference_mode():
        prompt = torch.tensor(ids, dtype=torch.long)
    steps = prefill_steps(runner.model, runner.cache, [prompt], [len(ids) + 1])
    pieces: list[tuple[str, float, float, int]] = []
    start = "start"
    while True:
        t0, c0, f0 = time.perf_counter(), time.thread_time(), _faults()
        try:
            with torch.inference_mode():
                next(steps)
        except StopIteration as done:
            pieces.append((f"{start} -> end", time.perf_counter() - t0, time.thread_time() - c0, _faults() - f0))
            _, states = done.value
            break
        seconds, cpu, faults = time.perf_counter() - t0, time.thread_time() - c0, _faults() - f0
        at, layer = where(steps)
        pieces.append((f"{start} -> {at}" + ("" if layer is None else f" [layer {layer}]"), seconds, cpu, faults))
        start = at
    for state in states:
        runner.free(state)
    return pieces


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    process = apply_process_settings()
    artifact = load_artifact(args.model)
    text = (args.data / BOOK).read_bytes()[200_000 : 200_000 + args.long_bytes].decode("utf-8", "ignore")
    ids = artifact.tokenizer.encode(text)
    runner = ModelRunner(artifact.model, torch.device("cpu"), max_slots=8)
    load_before = [round(v, 2) for v in os.getloadavg()]
    timed_pieces(runner, ids)  # warm-up
    runs = [timed_pieces(runner, ids) for _ in range(args.runs)]
    labels = [p[0] for p in runs[0]]
    assert all([p[0] for p in r] == labels for r in runs), "the pieces differ between runs"
    rows = [{"index": i, "label": label, "median_ms": round(statistics.median(r[i][1] for r in runs) * 1000, 1),
             "max_ms": round(max(r[i][1] for r in runs) * 1000, 1),
             "cpu_median_ms": round(statistics.median(r[i][2] for r in runs) * 1000, 1),
             "faults_max": max(r[i][3] for r in runs), "faults": [r[i][3] for r in runs]}
            for i, label in enumerate(labels)]
    key = "cpu_median_ms" if args.sort == "cpu" else "median_ms"
    by_label: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_label[str(row["label"]).split(" [layer")[0]].append(float(row[key]))
    longest = sorted(rows, key=lambda row: -float(row[key]))[: args.top]
    totals = [sum(p[1] for p in r) for r in runs]
    cpu_totals = [sum(p[2] for p in r) for r in runs]
    load_after = [round(v, 2) for v in os.getloadavg()]
    print(f"{len(ids)} tokens, {len(labels)} pieces, {args.threads} thread(s), runs {args.runs}: total "
          f"{', '.join(f'{t:.2f}' for t in totals)} s (CPU {', '.join(f'{t:.2f}' for t in cpu_totals)} s); "
          f"load average before {load_before}, after {load_after}")
    print(f"{'#':>5} {'median ms':>10} {'max ms':>8} {'cpu ms':>8} {'faults':>7}  piece (from yield -> to yield)")
    for row in longest:
        print(f"{row['index']:>5} {row['median_ms']:>10} {row['max_ms']:>8} {row['cpu_median_ms']:>8} "
              f"{row['faults_max']:>7}  {row['label']}")
    print(f"\nper label ({'CPU' if args.sort == 'cpu' else 'wall'} medians)\n{'count':>5} {'sum ms':>10} "
          f"{'max ms':>8}  label")
    for label, ms in sorted(by_label.items(), key=lambda kv: -max(kv[1]))[: args.top]:
        print(f"{len(ms):>5} {sum(ms):>10.1f} {max(ms):>8.1f}  {label}")
    if args.out is not None:
        write_json(args.out, {
            "benchmark": "prefill_pieces", "model": str(args.model or "export/default_artifact"),
            "tokens": len(ids), "threads": args.threads, "runs": args.runs, "process_settings": process,
            "total_s": [round(t, 3) for t in totals], "cpu_total_s": [round(t, 3) for t in cpu_totals], "pieces": rows,
            "load_before": load_before, "load_after": load_after})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
