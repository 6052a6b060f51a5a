"""Prefill time of this tree's model code against another commit's, or of one artifact against another, in one
process (in-process A/B).

    python bench/prefill/prefill_cost.py --against REV [--cases 1x256,8x256,1x4096,1x60000] [--reps 10]
                                 [--threads 1] [--artifact DIR] [--out bench/results/prefill_cost.json]
    python bench/prefill/prefill_cost.py --against-artifact DIR [--artifact DIR] ...

This machine's speed moves by up to 2x between runs minutes apart, so two code versions are compared in one
process, their calls alternating: `git archive REV model` is unpacked into a temporary directory as the
package `model_at_rev` (the model package imports itself only relatively), both packages build the same
artifact's weights (default: the shipped one) and each case (N prompts of L bytes of a book, `NxL`) is
prefilled by `model.decoding.prefill` of each, in turns, `--reps` times (4 for prompts past 20,000 bytes). The
table gives the median of each and the largest difference of their logits. With `--against-artifact`, this
tree's code prefills both artifacts' models (say, two hash-round counts), the logits differ by design, and the
JSON's `this_tree_ms` is `--artifact`'s time.
Writes the JSON and prints a table with the load average (run it through bench/quiet_run.sh).
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from export import load_artifact  # noqa: E402
from model.decoding.runtime import tune_cpu_runtime  # noqa: E402
from train.corpus_manifest import set_folder  # noqa: E402

BOOK = "war_and_peace_pg2600.txt"
OLD = "model_at_rev"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    against = p.add_mutually_exclusive_group(required=True)
    against.add_argument("--against", help="the git revision whose model/ is compared with this tree's")
    against.add_argument("--against-artifact", help="an artifact whose model this tree's code also prefills")
    p.add_argument("--cases", default="1x256,8x256,1x4096,1x60000", help="NxL: N prompts of L bytes each")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--artifact", default=None, help="artifact directory (default: the shipped one)")
    p.add_argument("--data", type=Path, default=set_folder("data"),
                   help="folder of books (default: corpus/data, written by `reformer data`)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefill_cost.json")
    return p


def import_model_at(rev: str, into: Path) -> Any:
    """`model/` at `rev` as the package OLD, unpacked under `into`."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "model"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        for member in archive.getmembers():
            member.name = OLD + member.name[len("model"):]
            archive.extract(member, into, filter="data")
    sys.path.insert(0, str(into))
    try:  # the cached-decoding API: model/decoding/ since 3076886, model/decode.py before
        return importlib.import_module(f"{OLD}.decoding")
    except ModuleNotFoundError:
        return importlib.import_module(f"{OLD}.decode")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_cpu_runtime()  # as `reformer serve` runs
    import model.decoding as new

    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    text = (args.data / BOOK).read_bytes()
    artifact = load_artifact(args.artifact)
    lm, tok = artifact.model.eval(), artifact.tokenizer
    longest = max(length for _, length in cases) + 256
    with tempfile.TemporaryDirectory() as tmp:
        if args.against_artifact is not None:
            other = args.against_artifact
            runs = {"this tree": (new, lm), other: (new, load_artifact(other).model.eval())}
        else:
            other = args.against
            old = import_model_at(args.against, Path(tmp))
            lm_old = importlib.import_module(OLD).ReformerLM(lm.config).eval()
            lm_old.load_state_dict(lm.state_dict())
            runs = {"this tree": (new, lm), other: (old, lm_old)}
        caches = {name: mod.DecodeCache(m, 2**31, 16, max_tokens=min(longest, lm.config.max_position_embeddings))
                  for name, (mod, m) in runs.items()}
        load_before = [round(v, 2) for v in os.getloadavg()]
        rows = []
        for n, length in cases:
            times: dict[str, list[float]] = {name: [] for name in runs}
            diff = 0.0
            for rep in range(args.reps if length <= 20_000 else min(args.reps, 4)):
                starts = [rep * 10_000 + i * 1_000 for i in range(n)]
                prompts = [torch.tensor(tok.encode(text[s : s + length].decode("utf-8", "ignore"))) for s in starts]
                logits = {}
                for name in (list(runs) if rep % 2 else list(runs)[::-1]):
                    mod, model = runs[name]
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        logits[name], states = mod.prefill(model, caches[name], prompts, [length + 16] * n)
                        times[name].append(time.perf_counter() - t0)
                    for state in states:
                        caches[name].free(state)
                a, b = logits.values()
                diff = max(diff, (a - b).abs().max().item())
            new_ms, old_ms = (statistics.median(times[name]) * 1e3 for name in runs)
            rows.append({"prompts": n, "bytes": length, "reps": len(times["this tree"]),
                         "this_tree_ms": round(new_ms, 2), "against_ms": round(old_ms, 2),
                         "ratio": round(new_ms / old_ms, 3), "logits_max_abs_diff": diff})
        if tmp in sys.path:
            sys.path.remove(tmp)
    commit = None if args.against is None else subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", args.against], check=True, capture_output=True, text=True).stdout.strip()
    out = {"benchmark": "prefill_cost", "against": other, "against_commit": commit,
           "against_artifact": args.against_artifact,
           "artifact": str(args.artifact or "export/default_artifact"), "threads": args.threads, "rows": rows,
           "load_before": load_before, "load_after": [round(v, 2) for v in os.getloadavg()]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    mine = "this tree" if args.against is not None else str(args.artifact or "export/default_artifact")
    print(f"prefill, median ms, {mine} against {other}, {args.threads} thread(s)")
    print(f"{'prompts x bytes':>16}{mine[-12:]:>12}{other[-12:]:>14}{'ratio':>8}{'logits diff':>13}")
    for r in rows:
        print(f"{r['prompts']:>7} x {r['bytes']:<6}{r['this_tree_ms']:>12.2f}{r['against_ms']:>14.2f}"
              f"{r['ratio']:>8.3f}{r['logits_max_abs_diff']:>13.2e}")
    print(f"load average before {load_before}, after {out['load_after']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
