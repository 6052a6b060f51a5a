"""Forward benchmark: tokens/s and peak RSS of one eval forward (batch 1) at 1K-64K tokens, for this
project, transformers' Reformer, reformer-pytorch and a full-attention transformer of the same size,
plus this machine's fp32 matmul ceiling, all in one run.

    python bench/forward/forward.py [--lengths 1024,4096,16384,65536] [--models ours,hf,rp,full] [--out FILE]

Each (model, length) runs in a fresh subprocess so its peak RSS is its own. Results go to
bench/results/forward.json (+ forward.png) and a table is printed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results
MODELS = {"ours": "reformer-serve (torch)", "hf": "transformers Reformer", "rp": "reformer-pytorch",
          "full": "full attention (SDPA)"}
VOCAB, HIDDEN, HEADS, HEAD, LAYERS, FF, CHUNK, HASHES = 258, 256, 4, 64, 6, 1024, 64, 4


def flops_per_token() -> float:
    """Multiply-adds x2 of one LSH layer stack per token: projections, feed-forward, attention scores and
    values (each query against 2 chunks, in every hash round), LM head."""
    proj = 2 * HIDDEN * HEADS * HEAD * 3
    ff = 2 * 2 * HIDDEN * FF
    attn = 2 * 2 * (2 * CHUNK) * HEAD * HEADS * HASHES
    return LAYERS * (proj + ff + attn) + 2 * 2 * HIDDEN * VOCAB


def build(kind: str, length: int):  # noqa: ANN201
    import torch

    if kind == "ours":
        from model import ReformerConfig, ReformerLM

        cfg = ReformerConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             attention_head_size=HEAD, attn_layers=["lsh"] * LAYERS, feed_forward_size=FF,
                             lsh_attn_chunk_length=CHUNK, num_hashes=HASHES, num_buckets=None,
                             axial_pos_shape=(256, 256), axial_pos_embds_dim=(64, 192),
                             max_position_embeddings=65536, hash_seed=0)
        lm = ReformerLM(cfg).eval()
        return lambda ids: lm(ids).logits
    if kind == "hf":
        from transformers import ReformerConfig as HFReformerConfig
        from transformers import ReformerModelWithLMHead

        hf_cfg = HFReformerConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             attention_head_size=HEAD, attn_layers=["lsh"] * LAYERS, feed_forward_size=FF,
                             lsh_attn_chunk_length=CHUNK, num_hashes=HASHES, num_buckets=None,
                             axial_pos_shape=(256, 256), axial_pos_embds_dim=(64, 192),
                             max_position_embeddings=65536, hash_seed=0, is_decoder=True, use_cache=False)
        hf = ReformerModelWithLMHead(hf_cfg).eval()
        return lambda ids: hf(ids, use_cache=False).logits
    if kind == "rp":
        from reformer_pytorch import ReformerLM as RPReformerLM

        rp = RPReformerLM(num_tokens=VOCAB, dim=HIDDEN, depth=LAYERS, heads=HEADS, dim_head=HEAD,
                          bucket_size=CHUNK, n_hashes=HASHES, ff_chunks=16, causal=True,
                          max_seq_len=max(length, 2 * CHUNK)).eval()
        return lambda ids: rp(ids)
    if kind == "full":
        from torch import nn

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
                self.qkv = nn.Linear(HIDDEN, 3 * HEADS * HEAD, bias=False)
                self.out = nn.Linear(HEADS * HEAD, HIDDEN, bias=False)
                self.ff = nn.Sequential(nn.Linear(HIDDEN, FF), nn.ReLU(), nn.Linear(FF, HIDDEN))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                b, t, _ = x.shape
                q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, HEAD).permute(2, 0, 3, 1, 4)
                a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.out(a.transpose(1, 2).reshape(b, t, HEADS * HEAD))
                return x + self.ff(self.ln2(x))

        emb, pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(65536, HIDDEN)
        blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        head = nn.Linear(HIDDEN, VOCAB)
        return lambda ids: head(blocks(emb(ids) + pos(torch.arange(ids.shape[1]))))
    raise ValueError(kind)


def run_case(kind: str, length: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    fwd = build(kind, length)
    ids = torch.randint(3, VOCAB, (1, length))
    with torch.no_grad():
        fwd(ids[:, : min(length, 1024)])  # warm-up
        reps, elapsed, cpu = 0, 0.0, 0.0
        while reps < 1 or (elapsed < 3.0 and reps < 5):
            start, cpu_start = time.perf_counter(), time.process_time()
            fwd(ids)
            elapsed += time.perf_counter() - start
            cpu += time.process_time() - cpu_start
            reps += 1
    # CPU seconds are what the process itself spent: on a shared machine they move far less with the
    # other processes' load than wall-clock seconds do (with --threads 1 they equal wall time when idle)
    return {"model": kind, "length": length, "tokens_per_s": length * reps / elapsed,
            "tokens_per_cpu_s": length * reps / cpu, "seconds": elapsed / reps, "cpu_seconds": cpu / reps,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def gflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e9


def ceiling_fraction(tokens_per_wall_s: float, flops_per_tok: float, ceiling_gflops: float) -> float:
    """Achieved FLOP/s over the matmul ceiling, both wall-clock and with the same thread count: tokens per
    wall-clock second x FLOP per token, against what `matmul_ceiling(threads)` reached. (Dividing CPU-time
    throughput by a per-thread ceiling counts every thread's seconds and halves the figure at 2 threads.)"""
    return tokens_per_wall_s * flops_per_tok / (ceiling_gflops * 1e9)


def matmul_ceiling(threads: int) -> float:
    """GFLOP/s of a 2048^3 fp32 matmul on `threads` threads, wall clock, best of 6."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return gflops(2 * 2048**3, best)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,16384,65536")
    p.add_argument("--models", default="ours,hf,rp,full")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900, help="seconds per case before it is recorded as failed")
    p.add_argument("--out", type=Path, default=RESULTS / "forward.json")
    p.add_argument("--case", nargs=2, metavar=("MODEL", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.threads)))
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    kinds = args.models.split(",")
    ceiling = matmul_ceiling(args.threads)
    rows = []
    for length in lengths:
        for kind in kinds:
            cmd = [sys.executable, __file__, "--case", kind, str(length), "--threads", str(args.threads)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                row = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {
                    "model": kind, "length": length, "error": proc.stderr.strip().splitlines()[-1][:200]}
            except subprocess.TimeoutExpired:
                row = {"model": kind, "length": length, "error": f"timed out after {args.timeout:.0f}s"}
            if "tokens_per_s" in row and kind in ("ours", "hf"):
                row["ceiling_fraction"] = ceiling_fraction(row["tokens_per_s"], flops_per_token(), ceiling)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    report = {"matmul_ceiling_gflops": ceiling, "flops_per_token": flops_per_token(), "threads": args.threads,
              "config": {"vocab": VOCAB, "hidden": HIDDEN, "heads": HEADS, "head_size": HEAD, "layers": LAYERS,
                         "ff": FF, "chunk": CHUNK, "hashes": HASHES}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    plot(report, args.out.with_suffix(".png"))
    return 0


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"forward, batch 1 (fp32 matmul ceiling {report['matmul_ceiling_gflops']:.0f} GFLOP/s "
                        f"wall clock on {report['threads']} thread(s))")
    for col in ("length", "model", "tokens/s (wall)", "tokens per CPU-s", "vs transformers (CPU-s)",
                "peak RSS (MB)", "of ceiling (wall)"):
        table.add_column(col)
    by = {(r["model"], r["length"]): r for r in report["rows"]}
    for r in report["rows"]:
        if "error" in r:
            table.add_row(str(r["length"]), MODELS[r["model"]], "failed", "", "", r["error"][:40])
            continue
        hf = by.get(("hf", r["length"]), {})
        ratio = f"{r['tokens_per_cpu_s'] / hf['tokens_per_cpu_s']:.2f}x" if "tokens_per_cpu_s" in hf else ""
        frac = f"{100 * r['ceiling_fraction']:.0f}%" if "ceiling_fraction" in r else ""
        table.add_row(str(r["length"]), MODELS[r["model"]], f"{r['tokens_per_s']:,.0f}",
                      f"{r['tokens_per_cpu_s']:,.0f}", ratio, f"{r['peak_rss_mb']:,.0f}", frac)
    Console().print(table)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, label in MODELS.items():
        rows = [r for r in report["rows"] if r["model"] == kind and "tokens_per_cpu_s" in r]
        if not rows:
            continue
        xs = [r["length"] for r in rows]
        ax1.plot(xs, [r["tokens_per_cpu_s"] for r in rows], marker="o", label=label)
        ax2.plot(xs, [r["peak_rss_mb"] for r in rows], marker="o", label=label)
    for ax, title in ((ax1, "tokens per CPU-second (batch 1, eval)"), (ax2, "peak RSS (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
