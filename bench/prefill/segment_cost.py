"""What a segment grid would cost if built from today's pieces: a prompt of L tokens prefilled in one forward
(today), against its first S tokens prefilled and the other L - S fed one decode step each (the only way the
code has to read tokens over a cached state, so the state at every cut depends only on the tokens before it).

    python bench/prefill/segment_cost.py [ARTIFACT] --book BOOK.txt [--lengths 4096,16384] [--segment 1024]
        [--out bench/results/segment_cost.json]

In process, the shipped model unless ARTIFACT, one row, the decode cache and decoder the service builds (fused
C step where it loads), 2 threads. For each length: tokens/s of the one-piece prefill, and of the segment
prefill plus steps; their ratio is the speed a cold request would keep under that semantics (issue 53 asks
for at least 0.9). The quality side is bench/decode/decode_quality.py's: cached decoding against the forward.
Writes the JSON and prints a table with the load. Run it alone (bench/quiet_run.sh)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from export import load_artifact  # noqa: E402
from model.decoding import DecodeCache, Decoder, prefill  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path, nargs="?", default=None)
    p.add_argument("--book", type=Path, required=True)
    p.add_argument("--lengths", default="4096,16384")
    p.add_argument("--segment", type=int, default=1024)
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/segment_cost.json")
    return p


@torch.inference_mode()
def measure(lm: Any, ids: torch.Tensor, segment: int) -> dict[str, float]:
    n = int(ids.shape[0])
    cache = DecodeCache.for_tokens(lm, n + 1)
    decoder = Decoder(lm, cache)
    began = time.perf_counter()
    _, (state,) = prefill(lm, cache, [ids], [n + 1])
    whole = time.perf_counter() - began
    cache.free(state)
    began = time.perf_counter()
    _, (state,) = prefill(lm, cache, [ids[:segment]], [n + 1])
    for t in ids[segment:].tolist():
        decoder.step([t], [state])
    stepped = time.perf_counter() - began
    return {"one_piece_tokens_per_s": n / whole, "segment_then_steps_tokens_per_s": n / stepped,
            "speed_ratio": whole / stepped}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(2)
    art = load_artifact(args.artifact) if args.artifact else load_artifact()
    lm = art.model.eval()
    text = args.book.read_text(encoding="utf-8", errors="replace")
    ids = torch.tensor(art.tokenizer.encode(text), dtype=torch.long)
    load = os.getloadavg()[0]
    rows = {}
    for n in (int(x) for x in args.lengths.split(",")):
        measure(lm, ids[:2048], min(args.segment, 1024))  # warm-up
        rows[n] = measure(lm, ids[:n], args.segment)
    result = {"load_before": load, "load_after": os.getloadavg()[0], "segment": args.segment, "rows": rows,
              "artifact": str(args.artifact or "shipped")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load {load:.2f} before, {result['load_after']:.2f} after; segment {args.segment}")
    print("| tokens | one forward (tok/s) | segment + steps (tok/s) | speed kept |\n|---|---|---|---|")
    for n, r in rows.items():
        print(f"| {n} | {r['one_piece_tokens_per_s']:.0f} | {r['segment_then_steps_tokens_per_s']:.0f} | "
              f"{r['speed_ratio']:.3f}x |")
    return result


if __name__ == "__main__":
    main()
