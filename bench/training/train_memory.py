"""Training memory vs depth: step time and peak RSS of one training step (forward, backward, AdamW) at
4096 tokens for 2, 6 and 12 layers, reversible layers against a plain residual network of the same
size (`lm.reversible = False`: ordinary autograd, which keeps every layer's activations).

    python bench/training/train_memory.py [--layers 2,6,12] [--tokens 4096] [--steps 2] [--out FILE.json]

Each (depth, variant) runs in a fresh process, so its peak RSS (`ru_maxrss`) is its own; "working set"
is peak RSS minus the RSS after imports and model build. Step time is the median over the timed steps
after one untimed warm-up step. The machine's load average is recorded with each row: on a shared
machine step times are noisy, memory is not."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def rss_now_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(layers: int, reversible: bool, tokens: int, steps: int, hidden: int, threads: int) -> dict[str, Any]:
    """One configuration, in this process (the parent runs each in a child)."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from model import ReformerConfig, ReformerLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = ReformerConfig(
        vocab_size=258, hidden_size=hidden, num_attention_heads=4, attention_head_size=hidden // 4,
        attn_layers=(["local", "lsh"] * layers)[:layers], feed_forward_size=4 * hidden,
        lsh_attn_chunk_length=64, local_attn_chunk_length=64, num_hashes=2, num_buckets=64,
        axial_pos_shape=(16, 4096), axial_pos_embds_dim=(hidden // 2, hidden // 2),
        max_position_embeddings=65536, hash_seed=0)
    lm = ReformerLM(cfg).train()
    lm.reversible = reversible
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    ids = torch.randint(2, 258, (1, tokens + 1), generator=torch.Generator().manual_seed(0))
    baseline = rss_now_mb()
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        logits = lm(ids[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i > 0:  # the first step is a warm-up (allocator, optimizer state)
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB -> MB on Linux
    return {
        "layers": layers, "variant": "reversible" if reversible else "plain", "tokens": tokens,
        "hidden_size": hidden, "parameters": lm.num_parameters(), "step_s_median": statistics.median(times),
        "step_s_all": times, "tokens_per_s": tokens / statistics.median(times), "peak_rss_mb": peak,
        "baseline_rss_mb": baseline, "working_set_mb": peak - baseline, "threads": threads,
        "loadavg_1m": os.getloadavg()[0],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| layers | variant | parameters | step time (s) | tokens/s | peak RSS (MB) | working set (MB) "
             "| load avg |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['variant']} | {r['parameters']:,} | {r['step_s_median']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['peak_rss_mb']:.0f} | {r['working_set_mb']:.0f} | "
                     f"{r['loadavg_1m']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="2,6,12")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "train_memory.json")
    p.add_argument("--child", help=argparse.SUPPRESS)  # "LAYERS,reversible|plain": run one config
    args = p.parse_args(argv)
    if args.child:
        layers, variant = args.child.split(",")
        print(json.dumps(measure(int(layers), variant == "reversible", args.tokens, args.steps, args.hidden,
                                 args.threads)))
        return 0
    rows = []
    for layers in (int(v) for v in args.layers.split(",")):
        for variant in ("reversible", "plain"):
            cmd = [sys.executable, __file__, "--child", f"{layers},{variant}", "--tokens", str(args.tokens),
                   "--steps", str(args.steps), "--hidden", str(args.hidden), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{layers:>3} layers {variant:<10} step {r['step_s_median']:.2f} s  peak RSS "
                  f"{r['peak_rss_mb']:.0f} MB  working set {r['working_set_mb']:.0f} MB", flush=True)
    print()
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "train_memory", "rows": rows, "table": table(rows),
                                    "machine": {"cpus": os.cpu_count()}}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
