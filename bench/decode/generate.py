"""Decode cost: time per new token after 1K-64K-token prompts, this project's exact LSH window cache against
transformers' cached decoding (`past_buckets_states`, what `generate(use_cache=True)` runs per step), at the
forward benchmark's config (6 LSH layers, hidden 256, 4 heads x 64, chunk 64, 4 hash rounds).

    python bench/decode/generate.py [--lengths 1024,4096,16384,32768,65536] [--models ours,hf] [--new-tokens 16]
                             [--batch-sizes 1,8,32] [--batch-prompt 1024] [--batch-all-threads]
                             [--decode-all-threads]
                             [--batch-artifact DIR] [--kv-cache-dtype float32|bfloat16|float16]

Each (model, length) runs in its own subprocess. Then, for this project only, one batched decode step over B
running requests (each after a `--batch-prompt`-token prompt) for every B in `--batch-sizes`: time per step
and total tokens/s, plotted against B, with the step's intra-op threads as the service's model runner sets
them (`model.decoding.step_threads`) and, with `--batch-all-threads`, again on every thread; with
`--batch-artifact`, on that artifact's model instead of the config above. `--kv-cache-dtype` keeps this
project's cached keys and values in that dtype (REFORMER_KV_CACHE_DTYPE; default float32, the model's, which
is the exact cache). `--decode-all-threads` also times our batch-1 decode with its steps on every thread (the
service runs a one-row step on one). Writes bench/results/generate.json and generate_batch.png and prints two tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results


def hf_config():  # noqa: ANN201
    from transformers import ReformerConfig

    return ReformerConfig(vocab_size=258, hidden_size=256, num_attention_heads=4, attention_head_size=64,
                          attn_layers=["lsh"] * 6, feed_forward_size=1024, lsh_attn_chunk_length=64, num_hashes=4,
                          num_buckets=None, axial_pos_shape=(256, 256), axial_pos_embds_dim=(64, 192),
                          max_position_embeddings=65536, hash_seed=0, is_decoder=True, eos_token_id=None,
                          pad_token_id=0)


def _kv_dtype(name: str):  # noqa: ANN202
    import torch

    return getattr(torch, name)


def run_case(kind: str, length: int, new_tokens: int, threads: int, kv: str = "float32",
             all_threads: bool = False) -> dict:
    """One (model, length) decode. Ours runs its steps as the service's model runner runs a one-row step (one
    intra-op thread: `step_threads`), or with `all_threads` on every thread (as a process with no event loop to
    leave a core to could); transformers always on every thread."""
    import torch

    torch.set_num_threads(threads)
    from model.decoding.runtime import tune_cpu_runtime

    tune_cpu_runtime()  # as `reformer serve` runs, for every model in the table
    torch.manual_seed(0)
    # the longest prompt leaves room for the new tokens inside max_position_embeddings (65536)
    prompt = torch.randint(3, 258, (min(length, 65536 - new_tokens - 2),))
    with torch.no_grad():
        if kind == "ours":
            from model import ReformerConfig, ReformerLM
            from model.decoding import DecodeCache, Decoder, prefill, step_threads

            lm = ReformerLM(ReformerConfig.from_hf(hf_config())).eval()
            dc = DecodeCache.for_tokens(lm, prompt.shape[0] + new_tokens + 2, kv_dtype=_kv_dtype(kv))
            decoder = Decoder(lm, dc)
            start = time.perf_counter()
            first, states = prefill(lm, dc, [prompt], [prompt.shape[0] + new_tokens + 2])
            prefill_s = time.perf_counter() - start
            token = first.argmax(-1)
            # as the service's model runner runs a step: inference mode, small steps on one thread
            scope = contextlib.nullcontext() if all_threads else step_threads(1)
            with torch.inference_mode(), scope:
                used = torch.get_num_threads()
                decoder.step(token, states)  # first step outside the timing (allocations)
                start, cpu_start = time.perf_counter(), time.process_time()
                for _ in range(new_tokens):
                    token = decoder.step(token, states).argmax(-1)
            per_token = (time.perf_counter() - start) / new_tokens
            cpu_per_token = (time.process_time() - cpu_start) / new_tokens
            cache = {"cache_bytes": dc.allocated_bytes, "cache_bytes_per_token": dc.allocated_bytes / states[0].length,
                     "kv_cache_dtype": kv, "step_threads": used, "threads_rule": "all" if all_threads else "service"}
        else:
            from transformers import ReformerModelWithLMHead

            hf = ReformerModelWithLMHead(hf_config()).eval()
            start = time.perf_counter()
            out = hf(prompt[None], use_cache=True)
            prefill_s = time.perf_counter() - start
            past, token = out.past_buckets_states, out.logits[:, -1:].argmax(-1)
            out = hf(token, past_buckets_states=past, use_cache=True)
            past, token = out.past_buckets_states, out.logits[:, -1:].argmax(-1)
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(new_tokens):
                out = hf(token, past_buckets_states=past, use_cache=True)
                past, token = out.past_buckets_states, out.logits[:, -1:].argmax(-1)
            per_token = (time.perf_counter() - start) / new_tokens
            cpu_per_token = (time.process_time() - cpu_start) / new_tokens
            cache = {}
    return {"model": kind, "length": length, "prefill_s": prefill_s, "ms_per_token": 1000 * per_token,
            "tokens_per_s": 1 / per_token, "cpu_ms_per_token": 1000 * cpu_per_token,
            "tokens_per_cpu_s": 1 / cpu_per_token,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **cache}


def run_batch_case(batch: int, length: int, steps: int, threads: int, all_threads: bool = False,
                   artifact: str | None = None, kv: str = "float32") -> dict:
    """One batched decode step over `batch` requests, each after its own `length`-token prompt; as the
    service's model runner runs it (`step_threads`), or with `all_threads` on every thread (as a process with
    nothing else to run would). `artifact`: that artifact's model instead of the benchmark's config."""
    import contextlib

    import torch

    from model import ReformerConfig, ReformerLM
    from model.decoding import DecodeCache, Decoder, prefill, step_threads

    torch.set_num_threads(threads)
    from model.decoding.runtime import tune_cpu_runtime

    tune_cpu_runtime()  # as `reformer serve` runs, for every model in the table
    torch.manual_seed(0)
    if artifact is not None:
        from export import load_artifact

        lm = load_artifact(artifact).model.eval()
    else:
        lm = ReformerLM(ReformerConfig.from_hf(hf_config())).eval()
    dc = DecodeCache.for_tokens(lm, length + steps + 2, slots=batch, kv_dtype=_kv_dtype(kv))
    decoder = Decoder(lm, dc)
    states = []
    with torch.no_grad():
        for _ in range(batch):
            states += prefill(lm, dc, [torch.randint(3, 258, (length,))], [length + steps + 2])[1]
        token = torch.full((batch,), 5)
    scope = contextlib.nullcontext() if all_threads else step_threads(batch)  # the runner's rule
    with torch.inference_mode(), scope:
        step_threads_used = torch.get_num_threads()
        token = decoder.step(token, states).argmax(-1)  # first step outside the timing
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(steps):
            token = decoder.step(token, states).argmax(-1)
        per_step = (time.perf_counter() - start) / steps
        cpu_per_step = (time.process_time() - cpu_start) / steps
    return {"batch": batch, "length": length, "ms_per_step": 1000 * per_step, "tokens_per_s": batch / per_step,
            "cpu_ms_per_step": 1000 * cpu_per_step, "step_threads": step_threads_used,
            "threads_rule": "all" if all_threads else "service", "kv_cache_dtype": kv}


def plot_batches(rows: list[dict], path: Path, artifact: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    if not ok:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    xs = sorted({r["batch"] for r in ok})
    labels = {"service": "step threads as the service runs it", "all": "step on every thread"}
    for rule in dict.fromkeys(r.get("threads_rule", "service") for r in ok):
        mine = [r for r in ok if r.get("threads_rule", "service") == rule]
        a.plot([r["batch"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=labels[rule])
        b.plot([r["batch"] for r in mine], [r["ms_per_step"] for r in mine], marker="o", label=labels[rule])
    label = artifact or "bench/decode/generate.py config"
    finish_batch_plot(fig, a, b, xs, f"{label}, {ok[0]['length']}-token prompts",
                      path, legend=a)


def finish_batch_plot(fig: Any, throughput: Any, step: Any, xs: list[int], title: str, path: Path,
                      step_yscale: str = "linear", legend: Any = None) -> None:
    """Label a figure's tokens/s and ms-per-step axes against the batch sizes `xs`, title it, save it to
    `path` and close it (this benchmark's and bench/decode/step_cost.py's plots)."""
    import matplotlib.pyplot as plt

    throughput.set(xscale="log", xlabel="running requests (batch)", ylabel="tokens/s (all requests)",
                   title="decode throughput")
    step.set(xscale="log", yscale=step_yscale, xlabel="running requests (batch)", ylabel="ms per step",
             title="time per decode step")
    for ax in (throughput, step):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
    if legend is not None:
        legend.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _subprocess_row(cmd: list[str], timeout: float, fallback: dict) -> dict:
    """One case in its own process; the row records the 1-minute load average when it started."""
    load = {"loadavg_1m_before": os.getloadavg()[0]}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            return {**json.loads(proc.stdout.strip().splitlines()[-1]), **load}
        return {**fallback, **load, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    except subprocess.TimeoutExpired:
        return {**fallback, **load, "error": f"timed out after {timeout:.0f}s"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,16384,32768,65536")
    p.add_argument("--models", default="ours,hf")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", type=Path, default=RESULTS / "generate.json")
    p.add_argument("--batch-sizes", default="1,8,32", help="running requests per step (empty: skip)")
    p.add_argument("--batch-prompt", type=int, default=1024, help="prompt tokens of each batched request")
    p.add_argument("--case", nargs=2, metavar=("MODEL", "LENGTH"), help=argparse.SUPPRESS)
    p.add_argument("--decode-all-threads", action="store_true",
                   help="also time our batch-1 decode with its steps on all --threads (the service runs a one-row "
                        "step on one: model.decoding.step_threads)")
    p.add_argument("--batch-all-threads", action="store_true",
                   help="also time every batch size with the step on all --threads (the service leaves one core "
                        "to its event loop: model.decoding.step_threads)")
    p.add_argument("--batch-artifact", help="run the batch cases on this artifact's model (e.g. "
                   "export/default_artifact) instead of the benchmark's config")
    p.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="what this project's decode cache keeps keys and values in (float32: exact)")
    p.add_argument("--batch-case", type=int, help=argparse.SUPPRESS)
    p.add_argument("--all-threads-case", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.new_tokens, args.threads,
                                  args.kv_cache_dtype, args.all_threads_case)))
        return 0
    if args.batch_case:
        print(json.dumps(run_batch_case(args.batch_case, args.batch_prompt, args.new_tokens, args.threads,
                                        args.all_threads_case, args.batch_artifact, args.kv_cache_dtype)))
        return 0
    rows = []
    for length in [int(x) for x in args.lengths.split(",") if x]:
        for kind in args.models.split(","):
            for extra in ([[], ["--all-threads-case"]] if kind == "ours" and args.decode_all_threads else [[]]):
                cmd = [sys.executable, __file__, "--case", kind, str(length), "--new-tokens", str(args.new_tokens),
                       "--threads", str(args.threads), "--kv-cache-dtype", args.kv_cache_dtype, *extra]
                rows.append(_subprocess_row(cmd, args.timeout, {"model": kind, "length": length}))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    batch_rows = []
    for extra in ([[], ["--all-threads-case"]] if args.batch_all_threads else [[]]):
        for batch in [int(x) for x in args.batch_sizes.split(",") if x]:
            cmd = [sys.executable, __file__, "--batch-case", str(batch), "--batch-prompt", str(args.batch_prompt),
                   "--new-tokens", str(args.new_tokens), "--threads", str(args.threads), *extra,
                   "--kv-cache-dtype", args.kv_cache_dtype,
                   *(["--batch-artifact", args.batch_artifact] if args.batch_artifact else [])]
            batch_rows.append(_subprocess_row(cmd, args.timeout, {"batch": batch, "length": args.batch_prompt,
                                                                  "threads_rule": "all" if extra else "service"}))
            print(json.dumps(batch_rows[-1]), file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"new_tokens": args.new_tokens, "threads": args.threads,
                                    "kv_cache_dtype": args.kv_cache_dtype, "rows": rows,
                                    "batch_model": args.batch_artifact or "bench config",
                                    "batch_rows": batch_rows}, indent=2))
    plot_batches(batch_rows, args.out.with_name(args.out.stem + "_batch.png"), args.batch_artifact)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode after a prompt (batch 1, greedy; our cache in {args.kv_cache_dtype})")
    for col in ("prompt", "model (step threads)", "prefill s", "ms/token (wall)", "CPU ms/token",
                "vs transformers (wall)", "vs transformers (CPU)", "cache MB", "B/token"):
        table.add_column(col)
    by = {(r["model"], r["length"]): r for r in rows}
    for r in rows:
        if "error" in r:
            table.add_row(str(r["length"]), r["model"], "failed", r["error"][:40], "", "", "", "", "")
            continue
        hf = by.get(("hf", r["length"]), {})
        wall = f"{hf['ms_per_token'] / r['ms_per_token']:.1f}x" if "ms_per_token" in hf else ""
        ratio = f"{r['tokens_per_cpu_s'] / hf['tokens_per_cpu_s']:.1f}x" if "tokens_per_cpu_s" in hf else ""
        label = r["model"] + (f" ({r['step_threads']}, {r['threads_rule']})" if "step_threads" in r else "")
        table.add_row(str(r["length"]), label, f"{r['prefill_s']:.2f}", f"{r['ms_per_token']:.2f}",
                      f"{r['cpu_ms_per_token']:.2f}", wall, ratio,
                      f"{r['cache_bytes'] / 2**20:.0f}" if "cache_bytes" in r else "",
                      f"{r['cache_bytes_per_token']:.0f}" if "cache_bytes_per_token" in r else "")
    Console().print(table)
    if batch_rows:
        bt = Table(title=f"batched decode steps ({args.batch_prompt}-token prompts, cache in {args.kv_cache_dtype})")
        for col in ("batch", "step threads", "ms/step", "CPU ms/step", "tokens/s", "step vs batch 1",
                    "tokens/s vs batch 1"):
            bt.add_column(col)
        for r in batch_rows:
            if "error" in r:
                bt.add_row(str(r["batch"]), "", "failed", r["error"][:40], "", "", "")
                continue
            one = next((o for o in batch_rows if o.get("batch") == 1 and "error" not in o
                        and o.get("threads_rule") == r.get("threads_rule")), None)
            bt.add_row(str(r["batch"]), f"{r['step_threads']} ({r['threads_rule']})", f"{r['ms_per_step']:.2f}",
                       f"{r['cpu_ms_per_step']:.2f}",
                       f"{r['tokens_per_s']:.0f}", f"{r['ms_per_step'] / one['ms_per_step']:.2f}x" if one else "",
                       f"{r['tokens_per_s'] / one['tokens_per_s']:.1f}x" if one else "")
        Console().print(bt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
