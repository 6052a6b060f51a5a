"""How a batch-1 decode step's time grows with the prompt, the lengths timed in turns in one process.

    python bench/decode/length_cost.py [--lengths 1024,4096,32768] [--steps 64] [--rounds 4] [--artifact DIR]
                                [--out FILE]

bench/decode/generate.py times each prompt length in its own process, one after another, so a swing in this
machine's memory speed between two cases reads as a difference between lengths: its 32K case took 1.25 to
2.34 ms a token in six runs of the same code one after another (by hand, load 0.02-0.70). Here every
length has its own request in one decode cache, prefilled first; then the lengths take turns, `--rounds`
rounds of `--steps` steps each, as the service's model runner runs a one-row step (`step_threads`), so a
swing falls on all of them alike. Each step is timed alone.

Per length it reports the mean time per new token over every timed step (what a stream sees, the merges of
the LSH index's recent order into its main order included: one every 64 steps, O(L)), the median step, the
slowest step and the position it wrote, and each mean against the shortest length's. An automatic bucket
count that doubles while a request decodes (at padded lengths of 32 * 2**k for bench/decode/generate.py's config)
rebuilds that request's index in one step, O(L log L): a prompt right below such a length shows it as its
slowest step. `--lengths` values are used as given, except that each is cut to leave room for the timed
steps in max_position_embeddings (`--below-boundary` also moves each one past a boundary it would cross,
so no rebuild falls in the timing).

Writes bench/results/length_cost.json and prints a table with the machine's load.
"""

from __future__ import annotations

import argparse
import contextlib
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

from bench.decode.step_cost import load_model  # noqa: E402
from model import ReformerLM  # noqa: E402
from model.attention import LSHSelfAttention  # noqa: E402
from model.decoding import DecodeCache, Decoder, prefill, step_threads  # noqa: E402
from model.decoding.runtime import tune_cpu_runtime  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def time_lengths(lm: ReformerLM, lengths: list[int], steps: int, rounds: int, seed: int = 1
                 ) -> dict[int, list[float]]:
    """Seconds of every timed step per prompt length: one request per length in one cache, `rounds` turns of
    `steps` steps each (the first step of each turn untimed: the caches refill after the other lengths')."""
    total = rounds * (steps + 1) + 2
    cache = DecodeCache.for_tokens(lm, max(lengths) + total, slots=len(lengths))
    decoder = Decoder(lm, cache)
    gen = torch.Generator().manual_seed(seed)
    states, tokens = {}, {}
    with torch.no_grad():
        for n in lengths:
            first, (state,) = prefill(lm, cache, [torch.randint(3, lm.config.vocab_size, (n,), generator=gen)],
                                      [n + total])
            states[n], tokens[n] = [state], first.argmax(-1).tolist()
    times: dict[int, list[float]] = {n: [] for n in lengths}
    with torch.inference_mode(), step_threads(1):
        for _ in range(rounds):
            for n in lengths:
                tokens[n] = decoder.step(tokens[n], states[n]).argmax(-1).tolist()
                for _ in range(steps):
                    start = time.perf_counter()
                    logits = decoder.step(tokens[n], states[n])
                    times[n].append(time.perf_counter() - start)
                    tokens[n] = logits.argmax(-1).tolist()
    return times


def summarize(times: dict[int, list[float]], steps: int) -> list[dict[str, Any]]:
    """Per length: mean and median ms a step, the slowest step and the position it wrote, and the mean
    against the shortest length's. `steps`: timed steps per turn (timed step k of turn r writes position
    prompt + r * (steps + 1) + 1 + k: each turn's first step is untimed)."""
    base = statistics.mean(times[min(times)])
    rows = []
    for n, ts in sorted(times.items()):
        worst = max(range(len(ts)), key=ts.__getitem__)
        turn, k = divmod(worst, steps)
        rows.append({"prompt": n, "mean_ms": 1000 * statistics.mean(ts), "median_ms": 1000 * statistics.median(ts),
                     "max_ms": 1000 * ts[worst], "max_at_position": n + turn * (steps + 1) + 1 + k,
                     "steps": len(ts), "mean_vs_shortest": statistics.mean(ts) / base})
    return rows


def next_boundary_clear(lm: ReformerLM, length: int, steps: int) -> int:
    """`length`, or the first length past the automatic bucket count's next change if decoding `steps`
    tokens from `length` would cross one (so the timed steps rebuild no index)."""
    cfg = lm.config
    if cfg.num_buckets is not None or "lsh" not in cfg.attn_layers:
        return length
    att = next(a for layer in lm.layers if isinstance(a := layer.attention.self_attention, LSHSelfAttention))
    count = att.num_buckets_for(cfg.padded_length(length + 1))
    for n in range(length + 1, length + steps + 2):
        if att.num_buckets_for(cfg.padded_length(n)) != count:
            return n
    return length


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,32768")
    p.add_argument("--steps", type=int, default=64, help="timed steps per length and turn")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="PyTorch's intra-op threads (prefill; a step takes one)")
    p.add_argument("--artifact", help="an artifact's model (e.g. export/default_artifact) instead of the config")
    p.add_argument("--below-boundary", action="store_true",
                   help="move a length whose decoding would change the automatic bucket count past the change")
    p.add_argument("--out", type=Path, default=RESULTS / "length_cost.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_cpu_runtime()
    load_before = os.getloadavg()[0]
    lm = load_model(args.artifact)
    total = args.rounds * (args.steps + 1) + 2
    lengths = [int(x) for x in args.lengths.split(",") if x]
    limit = lm.config.max_position_embeddings - total
    lengths = [min(n, limit) for n in lengths]
    if args.below_boundary:
        lengths = [next_boundary_clear(lm, n, total) for n in lengths]
    times = time_lengths(lm, lengths, args.steps, args.rounds)
    result = {"model": args.artifact or "bench config", "steps": args.steps, "rounds": args.rounds,
              "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
              "rows": summarize(times, args.steps)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    _print(result)
    return 0


def _print(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"batch-1 decode step against the prompt ({r['model']}, {r['rounds']} turns of {r['steps']} "
                    f"steps; load {r['loadavg_1m_before']:.2f} before, {r['loadavg_1m_after']:.2f} after)")
    for col in ("prompt", "mean ms", "median ms", "slowest ms (position)", "mean vs shortest"):
        t.add_column(col)
    for row in r["rows"]:
        t.add_row(str(row["prompt"]), f"{row['mean_ms']:.3f}", f"{row['median_ms']:.3f}",
                  f"{row['max_ms']:.1f} ({row['max_at_position']})", f"{row['mean_vs_shortest']:.2f}x")
    Console().print(t)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
