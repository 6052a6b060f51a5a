"""Greedy continuations of three English prompts by a model, the samples the model card prints.

    python bench/quality/samples.py [MODEL] [--new-bytes 80] [--out bench/results/default_model_samples.json]

MODEL is an artifact directory (default: export/default_artifact) or a training checkpoint. Decoding is
greedy with the decode cache (`model.decoding.generate.generate`), as the service decodes a request with
temperature 0, so the samples are the same on every run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from model.decoding.generate import generate  # noqa: E402
from train.evaluation import load_lm  # noqa: E402

PROMPTS = ["The prince said", "It was a bright cold day in April, and", "When the evening came, she"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, nargs="?", default=ROOT / "export" / "default_artifact")
    p.add_argument("--new-bytes", type=int, default=80, help="bytes generated after each prompt")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "default_model_samples.json")
    args = p.parse_args(argv)
    lm, tok = load_lm(args.model)
    samples = []
    for prompt in PROMPTS:
        ids = generate(lm, tok.encode(prompt), args.new_bytes)
        samples.append({"prompt": prompt, "greedy": tok.decode(ids)})
        print(f"{prompt!r} -> {samples[-1]['greedy']!r}")
    args.out.write_text(json.dumps(samples, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
