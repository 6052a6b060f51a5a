"""A long prompt arriving while streams decode (issue 12, item 4): the longest gap between the streams'
tokens while it is prefilled, and its prefill time against its time alone.

    python bench/prefill/prefill_gap.py [MODEL] [--data corpus/data] [--long-bytes 60000] [--streams 8]
                                [--stream-bytes 256] [--threads 2] [--prefill-budget-ms 100] [--prefill causal]
                                [--out bench/results/prefill_gap.json]

MODEL is an artifact directory (default: the shipped export/default_artifact). Everything runs in this
process through the service's own `Engine` (service/engine/core.py: its worker thread, its decode steps and its
interleaving of sliced prefills), without HTTP, under the service's process settings
(`service.api.server.apply_process_settings`):

1. alone: the long prompt (`--long-bytes` bytes of a book) prefilled by the engine with nothing else running
   (one piece, `ModelRunner.prefill`), timed from submission to its first token; then the same prompt
   through the sliced prefill (`ModelRunner.prefill_slices`) with no decode steps in between, each slice
   timed (the longest slice bounds the gap any interleaving can reach);
2. with streams: `--streams` generations of `--stream-bytes`-byte prompts decode; once each has produced
   `--warm-tokens` tokens the long prompt is submitted. Each stream's inter-token gaps (as the event loop
   receives the tokens) are split into before (tokens between warm-up and the submission) and during (the
   gap ends after the submission and at or before the long prompt's first token). The long prompt's
   prefill time is again submission to first token.

Writes the JSON and prints a table with the load average (run it through bench/quiet_run.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from export import load_artifact  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from service.api.server import apply_process_settings  # noqa: E402
from service.engine.core import Engine, EngineConfig, GenerationStream  # noqa: E402
from service.jobs import GenerationSpec  # noqa: E402
from service.observability.metrics import ServiceMetrics  # noqa: E402
from train.corpus_manifest import set_folder  # noqa: E402

BOOKS = ("war_and_peace_pg2600.txt", "crime_and_punishment_pg2554.txt")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="artifact directory (default: the shipped one)")
    p.add_argument("--data", type=Path, default=set_folder("data"),
                   help="folder of books (default: corpus/data, written by `reformer data`)")
    p.add_argument("--long-bytes", type=int, default=60_000)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-bytes", type=int, default=256)
    p.add_argument("--warm-tokens", type=int, default=24, help="tokens per stream before the long prompt arrives")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-budget-ms", type=float, default=EngineConfig.prefill_budget_ms,
                   help="the engine's budget for prefill slices between decode steps (REFORMER_PREFILL_BUDGET_MS)")
    p.add_argument("--prefill", choices=["one-piece", "causal"], default="one-piece",
                   help="how the engine reads prompts (REFORMER_PREFILL); causal: the exact extend, in slices")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefill_gap.json")
    return p


def _text(data: Path, book: str, start: int, size: int) -> bytes:
    raw = (data / book).read_bytes()
    return raw[start : start + size]


def _spec(ids: list[int], new: int) -> GenerationSpec:
    # greedy, no stop: every stream runs until it is cancelled or reaches `new`
    return GenerationSpec(prompt_ids=ids, sampling=SamplingParams(), max_new_tokens=new,
                          stop_on_eos=False)


def _summary(gaps: list[float]) -> dict[str, float | int]:
    if not gaps:
        return {"count": 0}
    ms = sorted(g * 1000.0 for g in gaps)
    return {"count": len(ms), "p50_ms": round(statistics.median(ms), 1),
            "p90_ms": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 1), "max_ms": round(ms[-1], 1)}


async def _first_token(engine: Engine, ids: list[int]) -> float:
    """Seconds from submitting a one-token generation to its token."""
    t0 = time.monotonic()
    stream = engine.generate(_spec(ids, 1))
    await stream.next_event()
    return time.monotonic() - t0


def _slice_profile(engine: Engine, ids: list[int]) -> dict[str, Any]:
    """The sliced prefill alone, each next() timed (called from this thread while the engine is idle)."""
    times: list[float] = []
    steps = engine.runner.prefill_slices([ids], [len(ids) + 1])
    t_all = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        try:
            next(steps)
        except StopIteration as done:
            times.append(time.perf_counter() - t0)
            _, states = done.value
            break
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - t_all
    for state in states:
        engine.runner.free(state)
    ms = sorted(t * 1000.0 for t in times)
    return {"slices": len(times), "total_s": round(total, 3), "slice_p50_ms": round(statistics.median(ms), 1),
            "slice_max_ms": round(ms[-1], 1), "longest_slice_index": max(range(len(times)), key=times.__getitem__)}


async def _with_streams(engine: Engine, long_ids: list[int], stream_ids: list[list[int]], warm: int
                        ) -> dict[str, Any]:
    arrivals: list[list[float]] = [[] for _ in stream_ids]
    streams: list[GenerationStream] = [engine.generate(_spec(ids, 4000)) for ids in stream_ids]
    warmed = asyncio.Event()
    stop = asyncio.Event()

    async def follow(i: int, stream: GenerationStream) -> None:
        while not stop.is_set():
            event = await stream.next_event()
            arrivals[i].append(time.monotonic())
            if all(len(a) >= warm for a in arrivals):
                warmed.set()
            if event.finish is not None:
                return

    tasks = [asyncio.create_task(follow(i, s)) for i, s in enumerate(streams)]
    await warmed.wait()
    submitted = time.monotonic()
    long_stream = engine.generate(_spec(long_ids, 1))
    await long_stream.next_event()
    first = time.monotonic()
    await asyncio.sleep(0.3)  # a few tokens after it, so the last gap during the prefill has its end
    stop.set()
    for s in streams:
        s.cancel()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    before, during = [], []
    per_stream = []
    for times in arrivals:
        gaps = [(b, b - a) for a, b in zip(times, times[1:])]
        # the first gaps may span the other streams' prefills, not decode steps: skip them
        pre = [g for end, g in gaps[2:] if end <= submitted]
        mid = [g for end, g in gaps if submitted < end <= first]
        # the gap spanning the long prompt's first token ends just after it; it is part of the stall too
        after = [g for end, g in gaps if end > first]
        if after:
            mid.append(after[0])
        before += pre
        during += mid
        per_stream.append({"before": _summary(pre), "during": _summary(mid)})
    return {"prefill_s": round(first - submitted, 3), "gaps_before": _summary(before),
            "gaps_during": _summary(during), "per_stream": per_stream}


async def _measure(engine: Engine, long_ids: list[int], stream_ids: list[list[int]], warm: int) -> dict[str, Any]:
    await _first_token(engine, stream_ids[0])  # warm-up: the first calls allocate and pick kernels
    alone = [await _first_token(engine, long_ids) for _ in range(2)]
    result: dict[str, Any] = {"alone_prefill_s": [round(a, 3) for a in alone]}
    result["with_streams"] = await _with_streams(engine, long_ids, stream_ids, warm)
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    # the service's process settings: without them glibc returns a 60K prompt's freed tensors to the kernel and
    # each next one page-faults on every page, and the GIL switch interval is Python's 5 ms
    process = apply_process_settings()
    artifact = load_artifact(args.model)
    tok = artifact.tokenizer
    long_ids = tok.encode(_text(args.data, BOOKS[0], 200_000, args.long_bytes).decode("utf-8", "ignore"))
    stream_ids = [tok.encode(_text(args.data, BOOKS[1], 50_000 + 7_919 * i, args.stream_bytes)
                             .decode("utf-8", "ignore")) for i in range(args.streams)]
    engine = Engine(artifact.model, tok, backend=None,  # type: ignore[arg-type]  # no embedding requests here
                    device=torch.device("cpu"), metrics=ServiceMetrics(),
                    config=EngineConfig(warmup=False, prefill_budget_ms=args.prefill_budget_ms,
                                        prefill=args.prefill))
    load_before = [round(v, 2) for v in os.getloadavg()]
    t0 = time.perf_counter()
    engine.start()
    try:
        result = asyncio.run(_measure(engine, long_ids, stream_ids, args.warm_tokens))
    finally:
        engine.stop()
    # the sliced prefill alone, with the engine stopped: no other thread touches the model
    result["sliced_alone"] = _slice_profile(engine, long_ids)
    alone = min(result["alone_prefill_s"])
    ws = result["with_streams"]
    out = {"benchmark": "prefill_gap", "model": str(args.model or "export/default_artifact"),
           "long_prompt_tokens": len(long_ids), "streams": args.streams,
           "stream_prompt_tokens": [len(s) for s in stream_ids], "threads": args.threads,
           "prefill_budget_ms": args.prefill_budget_ms, "prefill": args.prefill,
           "process_settings": {**process, "switch_interval_s": sys.getswitchinterval()}, **result,
           "prefill_ratio_vs_alone": round(ws["prefill_s"] / alone, 2),
           "seconds": round(time.perf_counter() - t0, 1), "load_before": load_before,
           "load_after": [round(v, 2) for v in os.getloadavg()]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    b, d, s = ws["gaps_before"], ws["gaps_during"], result["sliced_alone"]
    print(f"long prompt {len(long_ids)} tokens, {args.streams} streams of {len(stream_ids[0])}-token prompts, "
          f"{args.threads} threads, prefill budget {args.prefill_budget_ms:g} ms")
    print(f"{'':28}{'p50 ms':>10}{'p90 ms':>10}{'max ms':>10}{'gaps':>8}")
    for name, g in (("gaps before it arrives", b), ("gaps while it is prefilled", d)):
        print(f"{name:28}{g.get('p50_ms', '-'):>10}{g.get('p90_ms', '-'):>10}{g.get('max_ms', '-'):>10}"
              f"{g.get('count', 0):>8}")
    print(f"prefill alone {alone:.3f} s (runs {out['alone_prefill_s']}), with the streams {ws['prefill_s']:.3f} s: "
          f"x{out['prefill_ratio_vs_alone']}")
    print(f"sliced alone: {s['slices']} slices, {s['total_s']} s, slice p50 {s['slice_p50_ms']} ms, "
          f"max {s['slice_max_ms']} ms (slice #{s['longest_slice_index']})")
    print(f"load average before {load_before}, after {out['load_after']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
