"""Where a batched decode step's time goes, and how far the batching targets are from this machine's memory.

    python bench/decode/step_cost.py [--batch-sizes 1,2,4,8,16,32] [--prompt 1024] [--steps 48] [--rounds 3]
                              [--artifact DIR] [--kv-cache-dtype float32|bfloat16|float16] [--out FILE]

Times one decode step over B running requests (each after its own `--prompt`-token prompt) for every B, as
the service's model runner runs it (`model.decoding.step_threads`), at bench/decode/generate.py's config (or
`--artifact`'s model); the batch sizes take turns in `--rounds` rounds in one process, so a swing in the
machine's speed falls on all of them. It fits t(B) = a + b * B by least squares (for the plot and the
slope b; the intercept a is no measured cost and comes out below zero where t(B) bends upward), and gives
each added row's measured cost, (t(B) - t(1)) / (B - 1).

A row's share cannot fall below the time to read the bytes only it needs: the pool rows of its attention
windows, a key row and a value row (and an LSH slot's key norm) per layer, head and hash round, each row
once however many of its (row, head)'s rounds hold it. The benchmark counts those bytes from the model's
config and, for LSH layers, the share of window slots that hold a row no earlier slot holds (seen over one
step of the largest batch on the PyTorch path, which gathers the rows by index); it measures this machine's
single-thread sequential read bandwidth from memory (a sum over a 512 MiB tensor; scattered rows are read no
faster), and gives b_floor = those bytes / that bandwidth. Against issue 12's batching targets it gives
the per-row cost each one needs, with t(B) = t(1) + (B - 1) * b_B: a step at batch 8 at most 2x batch 1
needs b_8 <= t(1) / 7; tokens/s at batch 32 at least 8x batch 1 needs b_32 <= 3 * t(1) / 31.

Writes bench/results/step_cost.json and a plot beside it (time per step with the fit and the floor, and
tokens/s, against batch size), and prints a table with the machine's load.
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

from bench.decode.generate import finish_batch_plot, hf_config  # noqa: E402
from model import ReformerConfig, ReformerLM  # noqa: E402
from model.decoding import DecodeCache, Decoder, prefill, step_threads  # noqa: E402
from model.decoding.runtime import tune_cpu_runtime  # noqa: E402
from service.engine.backends import DTYPES  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BANDWIDTH_BYTES = 512 * 2**20


def read_bandwidth(nbytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Bytes per second one thread reads sequentially from a tensor far larger than the CPU's caches (best of
    `repeats` sums)."""
    x = torch.ones(nbytes // 4)
    best = float("inf")
    with step_threads(1):
        x.sum()
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
    return nbytes / best


def window_bytes_per_row(cfg: ReformerConfig, kv_bytes: int, lsh_distinct: float = 1.0) -> float:
    """Bytes of keys, values and (LSH) key norms one row's decode step reads from its own cache: each slot of
    every layer's windows, per head and hash round (model/kernels/csrc/window_attend.c reads each slot's key, and
    its value unless its probability is exactly 0). `lsh_distinct`: the share of an LSH layer's slots that
    hold a pool row no earlier slot of the same (row, head) holds (a row in two rounds' windows needs reading
    once). A causal local window holds its previous chunks and, on average, half of its own."""
    row = cfg.attention_head_size * kv_bytes
    total = 0.0
    for kind in cfg.attn_layers:
        if kind == "lsh":
            width = cfg.lsh_num_chunks_before + 1 + cfg.lsh_num_chunks_after
            slots: float = cfg.num_hashes * width * cfg.lsh_attn_chunk_length
            total += cfg.num_attention_heads * slots * lsh_distinct * (2 * row + 4)
        else:
            slots = cfg.local_num_chunks_before * cfg.local_attn_chunk_length + cfg.local_attn_chunk_length / 2
            total += cfg.num_attention_heads * slots * 2 * row
    return total


def lsh_distinct_share(decoder: Decoder, states: list[Any], tokens: list[int]) -> float | None:
    """The share of the LSH windows' slots, over one step of these rows, that hold a pool row no earlier
    slot of the same (row, head) holds (padding slots, which are never read, count as slots that hold none).
    The step runs on the PyTorch path, which works out each window's positions and padding
    (`LSHIndex.window`) and gathers the rows by their flat indices (`DecodeCache.gather_keys`), so both can be
    seen; the C kernel reads the same slots. None without LSH layers."""
    cache = decoder.cache
    absent: dict[int, torch.Tensor] = {}
    counted: list[tuple[torch.Tensor, torch.Tensor]] = []
    gather = cache.gather_keys
    watched = {li: ix for li, ix in enumerate(cache.indexes) if ix is not None}

    def watch_window(li: int, window: Any) -> Any:
        def spy(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            pos, pad = window(*args, **kwargs)
            absent[li] = pad.detach().clone()  # (B, H, R, W)
            return pos, pad
        return spy

    def watch_gather(layer: int, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if layer in watched:
            counted.append((flat.detach().clone(), absent.pop(layer)))
        return gather(layer, flat)

    kernel, fused = decoder.backends.window, decoder.backends.fused
    for li, ix in watched.items():
        ix.window = watch_window(li, ix.window)  # type: ignore[method-assign]
    cache.gather_keys = watch_gather  # type: ignore[method-assign]
    decoder.backends.window, decoder.backends.fused = None, None
    try:
        with torch.inference_mode():
            tokens[:] = decoder.step(tokens, states).argmax(-1).tolist()
    finally:
        del cache.gather_keys
        for ix in watched.values():
            del ix.window
        decoder.backends.window, decoder.backends.fused = kernel, fused
    slots = distinct = 0
    for flat, pad in counted:  # (B, H, R, W) each
        slots += flat.numel()
        for item, item_pad in zip(flat.flatten(0, 1).flatten(1), pad.flatten(0, 1).flatten(1)):
            distinct += int(torch.unique(item[~item_pad]).numel())
    return distinct / slots if slots else None


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares a, b of y = a + b * x."""
    b, a = statistics.linear_regression(xs, ys)
    return a, b


def load_model(artifact: str | None) -> ReformerLM:
    """bench/decode/generate.py's config (seed 0), or an artifact's model with the C kernels on."""
    if artifact is None:
        torch.manual_seed(0)
        return ReformerLM(ReformerConfig.from_hf(hf_config())).eval()
    from export import load_artifact
    from model import fused_attention as lsh_fused

    lm = load_artifact(artifact).model.eval()
    lsh_fused.use_c_kernels(lm, True)
    return lm


def time_steps(lm: ReformerLM, batch_sizes: list[int], prompt: int, steps: int, rounds: int,
               kv: torch.dtype) -> tuple[dict[int, list[float]], float | None]:
    """Seconds per step for every batch size, `rounds` turns of `steps` steps each, and the LSH windows'
    distinct share (`lsh_distinct_share`) over a step of the largest batch."""
    reserve = prompt + rounds * (steps + 1) + 8
    runs: dict[int, tuple[Decoder, list[Any], list[int]]] = {}
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in batch_sizes:
            cache = DecodeCache.for_tokens(lm, reserve, slots=b, kv_dtype=kv)
            decoder = Decoder(lm, cache)
            states: list[Any] = []
            for _ in range(b):
                states += prefill(lm, cache, [torch.randint(3, lm.config.vocab_size, (prompt,), generator=gen)],
                                  [reserve])[1]
            runs[b] = (decoder, states, [5] * b)
    times: dict[int, list[float]] = {b: [] for b in batch_sizes}
    distinct = lsh_distinct_share(*runs[max(batch_sizes)])
    with torch.inference_mode():
        for _ in range(rounds):
            for b, (decoder, states, tokens) in runs.items():
                with step_threads(b):
                    decoder.step(tokens, states)  # the first step of a turn untimed: caches refill
                    for _ in range(steps):
                        start = time.perf_counter()
                        logits = decoder.step(tokens, states)
                        times[b].append(time.perf_counter() - start)
                        tokens[:] = logits.argmax(-1).tolist()
    return times, distinct


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens of each running request")
    p.add_argument("--steps", type=int, default=48, help="timed steps per batch size and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="PyTorch's intra-op threads (the step takes its own)")
    p.add_argument("--artifact", help="an artifact's model (e.g. export/default_artifact) instead of the config")
    p.add_argument("--kv-cache-dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--out", type=Path, default=RESULTS / "step_cost.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_cpu_runtime()
    load_before = os.getloadavg()[0]
    bandwidth = read_bandwidth()
    lm = load_model(args.artifact)
    kv = DTYPES[args.kv_cache_dtype]
    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    if len(set(sizes)) < 2:
        p.error("--batch-sizes needs at least two sizes: the step's cost is fitted as a line in the batch size")
    times, distinct = time_steps(lm, sizes, args.prompt, args.steps, args.rounds, kv)
    median = {b: statistics.median(ts) for b, ts in times.items()}
    a, b = fit_line([float(x) for x in sizes], [median[x] for x in sizes])
    kv_bytes = torch.empty((), dtype=kv).element_size()
    slot_bytes = window_bytes_per_row(lm.config, kv_bytes)
    per_row = window_bytes_per_row(lm.config, kv_bytes, 1.0 if distinct is None else distinct)
    b_floor = per_row / bandwidth

    one = median.get(1)
    marginal = {x: (median[x] - one) / (x - 1) for x in sizes if one is not None and x > 1}
    needs = {}
    if one is not None and 8 in median:
        needs["step_8_vs_1"] = {"target": "at most 2.0x", "measured": median[8] / one,
                                "per_row_needed_ms": 1000 * one / 7, "per_row_measured_ms": 1000 * marginal[8]}
    if one is not None and 32 in median:
        needs["tokens_32_vs_1"] = {"target": "at least 8.0x", "measured": (32 / median[32]) * one,
                                   "per_row_needed_ms": 1000 * 3 * one / 31, "per_row_measured_ms": 1000 * marginal[32]}
    rows = [{"batch": x, "ms_per_step": 1000 * median[x], "fit_ms": 1000 * (a + b * x),
             "tokens_per_s": x / median[x], "ms_per_added_row": None if x not in marginal else 1000 * marginal[x]}
            for x in sizes]
    result = {
        "model": args.artifact or "bench config", "prompt": args.prompt, "kv_cache_dtype": args.kv_cache_dtype,
        "steps": args.steps, "rounds": args.rounds, "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0], "read_bandwidth_gb_s": bandwidth / 1e9,
        "window_bytes_per_row_every_slot": slot_bytes,
        "lsh_distinct_share": distinct, "window_bytes_per_row": per_row, "fixed_ms": 1000 * a, "per_row_ms": 1000 * b,
        "per_row_floor_ms": 1000 * b_floor, "per_row_vs_floor": b / b_floor, "rows": rows,
        "targets": needs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    _print(result)
    return 0


def plot(r: dict[str, Any], path: Path) -> None:
    """Time per step (measured, the fit, and t(1) plus the added rows at the floor) and tokens/s against B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [row["batch"] for row in r["rows"]]
    one = r["rows"][0]["ms_per_step"] if xs and xs[0] == 1 else None
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(xs, [row["ms_per_step"] for row in r["rows"]], marker="o", label="measured (median)")
    a.plot(xs, [row["fit_ms"] for row in r["rows"]], linestyle="--", label="fit a + b*B")
    if one is not None:
        a.plot(xs, [one + (x - 1) * r["per_row_floor_ms"] for x in xs], linestyle=":",
               label="t(1) + added rows at the read floor")
    b.plot(xs, [row["tokens_per_s"] for row in r["rows"]], marker="o")
    finish_batch_plot(fig, b, a, xs, f"{r['model']}, {r['prompt']}-token prompts, cache {r['kv_cache_dtype']}",
                      path, step_yscale="log", legend=a)


def _print(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"decode step against batch size ({r['model']}, {r['prompt']}-token prompts, cache "
                    f"{r['kv_cache_dtype']}; load {r['loadavg_1m_before']:.2f} before, "
                    f"{r['loadavg_1m_after']:.2f} after)")
    for col in ("batch", "ms/step (median)", "fit a + b*B", "ms per added row", "tokens/s"):
        t.add_column(col)
    for row in r["rows"]:
        added = row["ms_per_added_row"]
        t.add_row(str(row["batch"]), f"{row['ms_per_step']:.3f}", f"{row['fit_ms']:.3f}",
                  "" if added is None else f"{added:.3f}", f"{row['tokens_per_s']:.0f}")
    console.print(t)
    s = Table(title="a row's share against the memory it must read")
    for col in ("fit intercept a ms", "fit slope b ms", "window MB per row (every slot)", "LSH slots distinct",
                "distinct MB per row", "read GB/s (1 thread)", "b floor ms", "b / floor"):
        s.add_column(col)
    share = r["lsh_distinct_share"]
    s.add_row(f"{r['fixed_ms']:.3f}", f"{r['per_row_ms']:.3f}", f"{r['window_bytes_per_row_every_slot'] / 1e6:.2f}",
              "" if share is None else f"{share:.3f}", f"{r['window_bytes_per_row'] / 1e6:.2f}",
              f"{r['read_bandwidth_gb_s']:.1f}", f"{r['per_row_floor_ms']:.3f}", f"{r['per_row_vs_floor']:.1f}x")
    console.print(s)
    g = Table(title="issue 12's batching targets: the cost per added row each needs "
                    f"(floor {r['per_row_floor_ms']:.3f} ms)")
    for col in ("ratio", "target", "measured", "ms per added row needed", "ms per added row measured"):
        g.add_column(col)
    for key, label in (("step_8_vs_1", "step at 8 / step at 1"), ("tokens_32_vs_1", "tokens/s at 32 / at 1")):
        got = r["targets"].get(key)
        if got is not None:
            g.add_row(label, got["target"], f"{got['measured']:.2f}x", f"{got['per_row_needed_ms']:.3f}",
                      f"{got['per_row_measured_ms']:.3f}")
    console.print(g)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
