"""Forward throughput of one artifact on every backend, in one run: torch eager (what the service's torch
backend runs), torch.compile of the export graph's module, onnxruntime fp32 (model.onnx) and int8
(model.int8.onnx, quantised here when the artifact has none). Batch 1, tokens/s at each length, the
median of a few timed calls after one warm-up call, and each backend's max abs logits difference from
torch eager on the same input.

    python bench/forward/backends.py [--artifact DIR] [--lengths 1024,4096,16384] [--repeats 3] [--no-compile]

Writes bench/results/backends.json and the table in bench/forward/README.md's "Backends" section.
torch.compile (dynamic=False) compiles once per new length; its compile time is reported apart from its
steady-state speed, which is what a server with a few fixed length buckets would see.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from export import load_artifact  # noqa: E402
from export.onnx_export import OnnxForward, ort_session  # noqa: E402
from export.quantize import quantize_int8  # noqa: E402

README = ROOT / "bench" / "forward" / "README.md"
START, END = "<!-- backends:start -->", "<!-- backends:end -->"
Forward = Callable[[torch.Tensor, torch.Tensor], np.ndarray]


def timed(fn: Forward, ids: torch.Tensor, mask: torch.Tensor, repeats: int
          ) -> tuple[float, float, float, np.ndarray]:
    """(first call seconds, median wall seconds and median process CPU seconds of `repeats` later calls,
    logits). CPU time counts every thread of this process; on a shared machine it moves less with other
    jobs' load than wall time does."""
    t0 = time.perf_counter()
    logits = fn(ids, mask)
    first = time.perf_counter() - t0
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn(ids, mask)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return first, statistics.median(times), statistics.median(cpu), logits


def backends(art: Any, int8_path: Path, threads: int, use_compile: bool) -> dict[str, Forward]:
    model = art.model

    def eager(ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return model(ids, mask).logits.numpy()

    out: dict[str, Forward] = {"torch eager": eager}
    if use_compile:
        compiled = torch.compile(OnnxForward(model).eval(), dynamic=False)

        def compiled_fn(ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
            with torch.no_grad():
                return compiled(ids, mask)[0].numpy()

        out["torch.compile"] = compiled_fn
    for name, path in (("onnxruntime fp32", art.onnx_path), ("onnxruntime int8", int8_path)):
        session = ort_session(path, threads)

        def run(ids: torch.Tensor, mask: torch.Tensor, s: Any = session) -> np.ndarray:
            return s.run(["logits"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]

        out[name] = run
    return out


def measure(art: Any, int8_path: Path, lengths: list[int], repeats: int, threads: int,
            use_compile: bool) -> list[dict[str, Any]]:
    fns = backends(art, int8_path, threads, use_compile)
    rows = []
    for length in lengths:
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(2, art.config.vocab_size, (1, length), generator=g)
        mask = torch.ones_like(ids)
        reference: np.ndarray | None = None
        eager_s = None
        for name, fn in fns.items():  # interleaved per length, so load changes hit every backend alike
            first, median, cpu, logits = timed(fn, ids, mask, repeats)
            if reference is None:
                reference, eager_s = logits, median
            assert eager_s is not None
            rows.append({
                "backend": name, "length": length, "seconds": median, "cpu_seconds": cpu,
                "first_call_seconds": first,
                "tokens_per_s": length / median, "speedup_vs_eager": eager_s / median,
                "max_abs_diff_vs_eager": float(np.abs(logits - reference).max()),
            })
            print(f"{length:>6} {name:<18} {median:8.3f} s  {length / median:10.0f} tok/s", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="forward, batch 1")
    for col in ("length", "backend", "tokens/s", "x eager", "CPU s", "max |diff| vs eager", "first call s"):
        t.add_column(col, justify="left" if col == "backend" else "right")
    for r in rows:
        t.add_row(str(r["length"]), r["backend"], f"{r['tokens_per_s']:,.0f}", f"{r['speedup_vs_eager']:.2f}",
                  f"{r['cpu_seconds']:.3f}", f"{r['max_abs_diff_vs_eager']:.1e}", f"{r['first_call_seconds']:.2f}")
    return t


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        f"Run {result['date']} on {env['cpus']} CPUs ({env['machine']}), load average before/after "
        f"{env['load_before']} / {env['load_after']}; torch {env['torch']} ({env['torch_threads']} threads), "
        f"onnxruntime {env['onnxruntime']}; artifact `{result['artifact']}` ({result['parameters']:,} parameters, "
        f"weights sha256 {result['sha256'][:12]}). Median of {result['repeats']} calls after one warm-up.",
        "",
        "| length | backend | tokens/s | x eager | CPU s per call | max abs diff vs eager | first call (s) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['length']} | {r['backend']} | {r['tokens_per_s']:,.0f} | {r['speedup_vs_eager']:.2f} | "
                     f"{r['cpu_seconds']:.3f} | {r['max_abs_diff_vs_eager']:.1e} | {r['first_call_seconds']:.2f} |")
    return "\n".join(lines)


def update_readme(text: str, path: Path = README) -> None:
    """Replace the table between the Backends markers (adding the section when it is missing)."""
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{START}\n{text}\n{END}"
    if START in current and END in current:
        head, rest = current.split(START, 1)
        updated = head + block + rest.split(END, 1)[1]
    else:
        updated = current.rstrip("\n") + f"\n\n## Backends\n\n{block}\n"
    path.write_text(updated)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=None, help="artifact directory (default: the shipped one)")
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch and onnxruntime threads (0: their defaults)")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "backends.json")
    p.add_argument("--no-readme", action="store_true", help="do not update bench/forward/README.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    art = load_artifact(args.artifact)
    if art.onnx_path is None:
        print(f"{art.path} has no model.onnx; export it with ONNX first", file=sys.stderr)
        return 1
    lengths = [int(v) for v in args.lengths.split(",")]
    load_before = [round(v, 2) for v in os.getloadavg()]
    with tempfile.TemporaryDirectory() as tmp:
        int8_path = art.onnx_int8_path
        if int8_path is None:
            int8_path = Path(tmp) / "model.int8.onnx"
            quantize_int8(art.onnx_path, int8_path)
        rows = measure(art, int8_path, lengths, args.repeats, args.threads, not args.no_compile)
    import onnxruntime

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "artifact": str(art.path.relative_to(ROOT) if art.path.is_relative_to(ROOT) else art.path),
        "sha256": art.sha256, "parameters": art.model.num_parameters(), "repeats": args.repeats,
        "int8_quantised_here": art.onnx_int8_path is None,
        "environment": {"cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                        "onnxruntime": onnxruntime.__version__, "load_before": load_before,
                        "load_after": [round(v, 2) for v in os.getloadavg()]},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    Console().print(table(rows))
    if not args.no_readme:
        update_readme(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
