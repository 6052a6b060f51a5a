"""How far the ONNX backends agree with torch on the test set, and how often an LSH hash near-tie flips.

    python bench/export/backend_agreement.py --test-books DIR [--artifact DIR] [--window 4096]
        [--windows-per-book 8] [--flip-inputs 40] [--threads 2] [--out bench/results/backend_agreement.json]

What it measures, on the artifact's model (default: the shipped one) and its model.onnx / model.int8.onnx:

- **Quality**: `--windows-per-book` windows of `--window` tokens from each test book (bench/unseen_books.py:
  whole books no model trained on, Gutenberg header and licence removed), evenly spaced through the book. Each
  window's every position but the last predicts the next byte: bits per byte (the tokenizer is byte-level) of
  torch eager, onnxruntime fp32 and int8, and greedy agreement: the share of positions whose most likely next
  byte (argmax) is torch's. Both graphs read the same windows as torch.
- **Near-tie flips**: every quality window and `--flip-inputs` more inputs of random lengths (65-4,096 tokens,
  from random places in the books, seeded) go through the export's tie-aware check (export/onnx_ties.py):
  each LSH hash decision of the fp32 graph against torch's, a differing one recorded with torch's top-two
  margin, and the graph fed torch's buckets held to the export's tolerance. Reported: inputs with a flip,
  flips, the largest margin of a flip, and what the flips did to the graph's own output (largest logit
  difference, greedy disagreements, mean log-likelihood change) against inputs without one.
- **torch's own variants** (on the first `--variant-inputs` of those random inputs): torch's hash decisions
  with the C kernels off and in bfloat16 against torch float32 with them on, per LSH layer.
- **Determinism** (on the first `--determinism-inputs` windows): the same input twice, alone and as the first
  row of a right-padded batch with a shorter row, and on 1 thread against `--threads`: bit for bit or not,
  for torch eager and onnxruntime fp32 and int8.

Writes the JSON to `--out`; load averages before and after are in it. Quick on the shipped model: a few
minutes on 2 cores."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.unseen_books import add_test_books_arg, describe, whole_books  # noqa: E402
from export import load_artifact  # noqa: E402
from export.onnx_export import ExportError, max_export_length, ort_session, run_ort  # noqa: E402
from export.onnx_ties import TieCheck, capture_hashes, decision_margins  # noqa: E402
from model.fused_attention import use_c_kernels  # noqa: E402
from model.lsh.hashing import bucket_factors, hash_rotations, rotation_size  # noqa: E402


def bits(logits: np.ndarray, ids: np.ndarray) -> float:
    """Sum of -log2 p(next token) over positions 0..L-2 of one row: logits (L, V), ids (L,)."""
    z = torch.from_numpy(logits[:-1]).double()
    logp = torch.log_softmax(z, dim=-1).gather(-1, torch.from_numpy(ids[1:]).view(-1, 1))
    return float(-logp.sum() / math.log(2))


def windows(books: list[tuple[str, np.ndarray]], window: int, per_book: int) -> list[tuple[str, np.ndarray]]:
    out = []
    for name, ids in books:
        starts = np.linspace(0, max(len(ids) - window, 0), per_book).astype(int)
        out += [(name, ids[s : s + window]) for s in sorted(set(starts.tolist()))]
    return out


def random_inputs(books: list[tuple[str, np.ndarray]], count: int, seed: int, longest: int
                  ) -> list[tuple[str, np.ndarray]]:
    """`count` inputs of log-uniform lengths 65..`longest` from random places of random books."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        name, ids = books[int(rng.integers(len(books)))]
        n = int(np.exp(rng.uniform(np.log(65), np.log(longest))))
        start = int(rng.integers(0, len(ids) - n))
        out.append((name, ids[start : start + n]))
    return out


def quality(check: TieCheck, int8: Any, inputs: list[tuple[str, np.ndarray]]) -> tuple[dict[str, Any], list]:
    """Bits per byte and greedy agreement of both graphs against torch; the tie-check records of the inputs."""
    totals = {"torch": 0.0, "fp32": 0.0, "int8": 0.0}
    agree = {"fp32": 0, "int8": 0}
    scored = 0
    records = []
    for name, row in inputs:
        ids = torch.from_numpy(row).view(1, -1)
        mask = torch.ones_like(ids)
        record, ref, fp32 = check.check_outputs(ids, mask)
        low, _ = run_ort(int8, ids, mask)
        records.append((name, len(row), record, ref[0], fp32[0]))
        best = ref[0, :-1].argmax(-1)
        for key, out in (("torch", ref[0]), ("fp32", fp32[0]), ("int8", low[0])):
            totals[key] += bits(out, row)
            if key != "torch":
                agree[key] += int((out[:-1].argmax(-1) == best).sum())
        scored += len(row) - 1
    result = {"windows": len(inputs), "scored_bytes": scored,
              "bits_per_byte": {k: v / scored for k, v in totals.items()},
              "greedy_agreement_with_torch": {k: v / scored for k, v in agree.items()}}
    return result, records


def flip_summary(records: list) -> dict[str, Any]:
    """What the near-tie flips were and what they did to the graph's own output, against inputs without."""
    rows: dict[str, list[dict[str, Any]]] = {"with_flips": [], "without_flips": []}
    margins, total = [], 0
    for name, length, record, ref, out in records:
        flips = record.get("flips", [])
        total += len(flips)
        margins += [f["margin"] for f in flips]
        greedy = int((out[:-1].argmax(-1) != ref[:-1].argmax(-1)).sum())
        whole = record.get("whole_input", {})
        rows["with_flips" if flips else "without_flips"].append({
            "book": name, "length": length, "flips": flips, "greedy_disagreements": greedy,
            "max_abs_diff_logits": float(np.abs(out - ref).max()),
            "nll_relative_diff": whole.get("nll_relative_diff"),
            "fed_max_abs_diff_logits": record["logits"] if record["hashes"] else None})
    summary = {"inputs": len(records), "inputs_with_flips": len(rows["with_flips"]), "flips": total,
               "largest_flip_margin": max(margins) if margins else None}
    for key, group in rows.items():
        if group:
            summary[key] = {"inputs": len(group),
                            "max_abs_diff_logits_max": max(r["max_abs_diff_logits"] for r in group),
                            "greedy_disagreements_total": sum(r["greedy_disagreements"] for r in group),
                            "positions": sum(r["length"] for r in group)}
    summary["inputs_detail"] = rows["with_flips"]
    return summary


def torch_variants(model: Any, inputs: list[tuple[str, np.ndarray]]) -> dict[str, Any]:
    """Hash decisions of torch itself with the C kernels off, and in bfloat16, against torch float32 with the
    kernels on (what export checks against): per LSH layer, the inputs where some decision differs, how many
    differ, and the largest of their top-two margins (torch float32's, as the export check computes them).
    A later layer's differing decisions may follow from an earlier layer's, so their margins can be large."""
    nb = model.config.num_buckets
    rotations = hash_rotations(model.config.hash_seed, model.config.num_attention_heads,
                               model.config.attention_head_size, model.config.num_hashes, rotation_size(nb))
    off = copy.deepcopy(model)
    use_c_kernels(off, False)
    variants = {"C kernels off": off, "bfloat16": copy.deepcopy(model).to(torch.bfloat16)}
    found: dict[str, dict[str, Any]] = {}
    for _, row in inputs:
        ids = torch.from_numpy(row).view(1, -1)
        with torch.no_grad(), capture_hashes(model) as ref:
            model(ids)
        for name, variant in variants.items():
            with torch.no_grad(), capture_hashes(variant) as other:
                variant(ids)
            entry = found.setdefault(name, {"inputs": 0, "inputs_with_differences": 0, "layers": {}})
            entry["inputs"] += 1
            differs = False
            for a, b in zip(ref, other):
                if a.buckets is None or b.buckets is None:
                    continue
                where = np.argwhere((a.buckets != b.buckets).numpy())  # (N, 4): row, head, round, position
                layer = entry["layers"].setdefault(str(a.layer), {"inputs_with_differences": 0, "decisions": 0,
                                                                  "largest_margin": None})
                if len(where):
                    differs = True
                    ours, theirs = (t.numpy()[tuple(where.T)] for t in (b.buckets, a.buckets))
                    margins = decision_margins(a.qk, rotations, bucket_factors(nb), where, ours, theirs)
                    layer["inputs_with_differences"] += 1
                    layer["decisions"] += len(where)
                    layer["largest_margin"] = max(float(margins.max()), layer["largest_margin"] or 0.0)
            entry["inputs_with_differences"] += int(differs)
    return found


def determinism(model: Any, graphs: dict[str, Path], inputs: list[tuple[str, np.ndarray]], threads: int
                ) -> dict[str, Any]:
    """Bit-for-bit checks: again, batched (first row of a right-padded batch), and on 1 thread."""
    def torch_run(ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return model(ids, mask).logits.numpy()

    sessions = {(name, n): ort_session(path, n) for name, path in graphs.items() for n in (1, threads)}
    found: dict[str, dict[str, Any]] = {}
    for _, row in inputs:
        ids = torch.from_numpy(row).view(1, -1)
        mask = torch.ones_like(ids)
        short = len(row) // 3
        batch = torch.stack([ids[0], torch.cat([ids[0, :short], torch.zeros(len(row) - short, dtype=torch.long)])])
        bmask = torch.stack([mask[0], (torch.arange(len(row)) < short).long()])
        runs = {}
        torch.set_num_threads(threads)
        runs["torch"] = (torch_run(ids, mask), torch_run(ids, mask), torch_run(batch, bmask)[:1])
        torch.set_num_threads(1)
        one = torch_run(ids, mask)
        torch.set_num_threads(threads)
        runs["torch"] += (one,)
        for name in graphs:
            s, s1 = sessions[(name, threads)], sessions[(name, 1)]
            runs[name] = (run_ort(s, ids, mask)[0], run_ort(s, ids, mask)[0], run_ort(s, batch, bmask)[0][:1],
                          run_ort(s1, ids, mask)[0])
        for name, (first, again, batched, single) in runs.items():
            entry = found.setdefault(name, {"again": 0.0, "batched": 0.0, "one_thread": 0.0, "inputs": 0})
            entry["inputs"] += 1
            for key, other in (("again", again), ("batched", batched), ("one_thread", single)):
                entry[key] = max(entry[key], float(np.abs(other - first).max()))
    return {"max_abs_diff": found, "threads": threads,
            "what": "largest logit difference from the first run alone: run again, as the first row of a batch "
                    "with a row a third as long (right padding), and on 1 thread; 0.0 is bit for bit"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=None, help="artifact directory (default: the shipped one)")
    add_test_books_arg(p)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--windows-per-book", type=int, default=8)
    p.add_argument("--flip-inputs", type=int, default=40)
    p.add_argument("--determinism-inputs", type=int, default=2)
    p.add_argument("--variant-inputs", type=int, default=20, help="flip inputs also run through torch's variants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "backend_agreement.json")
    args = p.parse_args(argv)
    if args.test_books is None:
        p.error("--test-books DIR is required (the figures are the test set's)")
    torch.set_num_threads(args.threads)
    art = load_artifact(args.artifact)
    if art.onnx_path is None or art.onnx_int8_path is None:
        print(f"{art.path} lacks model.onnx or model.int8.onnx: `reformer export-onnx ARTIFACT --quantize int8`",
              file=sys.stderr)
        return 1
    graphs = {"onnxruntime fp32": art.onnx_path, "onnxruntime int8": art.onnx_int8_path}
    load_before = [round(v, 2) for v in os.getloadavg()]
    start = time.perf_counter()
    books = whole_books(args.test_books, art.tokenizer)
    check = TieCheck(art.model, art.onnx_path)
    int8 = ort_session(art.onnx_int8_path, args.threads)
    quality_inputs = windows(books, args.window, args.windows_per_book)
    flip_inputs = random_inputs(books, args.flip_inputs, args.seed, min(4096, max_export_length(art.model)))
    try:
        result_quality, records = quality(check, int8, quality_inputs)
        for name, row in flip_inputs:
            ids = torch.from_numpy(row).view(1, -1)
            record, ref, out = check.check_outputs(ids, torch.ones_like(ids))
            records.append((name, len(row), record, ref[0], out[0]))
    except ExportError as e:  # a failed check is a finding, not a crash
        print(f"the tie-aware check refused an input: {e}", file=sys.stderr)
        return 1
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "artifact": str(art.path.relative_to(ROOT) if art.path.is_relative_to(ROOT) else art.path),
        "sha256": art.sha256, "test_books": describe(args.test_books), "window": args.window,
        "quality": result_quality, "near_tie_flips": flip_summary(records),
        "torch_variants": torch_variants(art.model, flip_inputs[: args.variant_inputs]),
        "determinism": determinism(art.model, graphs, quality_inputs[: args.determinism_inputs], args.threads),
        "environment": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": args.threads,
                        "onnxruntime": __import__("onnxruntime").__version__, "load_before": load_before,
                        "load_after": [round(v, 2) for v in os.getloadavg()]},
        "seconds": round(time.perf_counter() - start, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    q, f = result["quality"], result["near_tie_flips"]
    print(f"bits per byte: torch {q['bits_per_byte']['torch']:.4f}, onnxruntime fp32 {q['bits_per_byte']['fp32']:.4f}, "
          f"int8 {q['bits_per_byte']['int8']:.4f}; greedy agreement fp32 "
          f"{q['greedy_agreement_with_torch']['fp32']:.4%}, int8 {q['greedy_agreement_with_torch']['int8']:.4%}")
    print(f"near-tie flips: {f['flips']} in {f['inputs_with_flips']} of {f['inputs']} inputs; "
          f"largest margin {f['largest_flip_margin']}")
    print(json.dumps(result["determinism"]["max_abs_diff"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
