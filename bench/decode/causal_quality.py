"""What the causal semantics (REFORMER_PREFILL=causal) costs in quality: bits per byte over every position of
windows of the test set, read by the one-piece forward and read causally, as the service's causal prefill reads
a prompt (service/engine/runner.py `extend_slices`: the extend from position 0, which leaves what one decode
step per token leaves; the per-position logits here come from those steps).

    python bench/decode/causal_quality.py --test-books DIR [--artifact DIR] [--lengths 4096,16384] [--out FILE]

Each window is the first tokens of each whole book of --test-books (the test set's books, their Gutenberg header
and licence removed: bench/unseen_books.py); every position after the first is predicted both ways. Also
reported: how often the two ways' top-1 predictions agree. Writes bench/results/causal_quality_<date>.json and
prints a table."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.unseen_books import add_test_books_arg, whole_books  # noqa: E402
from export import load_artifact  # noqa: E402
from model.decoding import DecodeCache, Decoder  # noqa: E402
from model.decoding.extend import open_indexes  # noqa: E402


@torch.inference_mode()
def both_ways(lm: torch.nn.Module, ids: list[int]) -> tuple[float, float, float]:
    """(one-piece bits per token, causal bits per token, top-1 agreement) over positions 1..len-1."""
    x = torch.tensor(ids)
    targets = x[1:]
    full = lm(x[None, :-1]).logits[0].float()  # (L-1, vocab): position i predicts ids[i+1]
    cache = DecodeCache.for_tokens(lm, len(ids))
    decoder = Decoder(lm, cache)
    state = cache.allocate(len(ids))
    open_indexes(decoder, state)  # read from position 0, as the service's causal prefill reads a prompt
    causal = [decoder.step([token], [state])[0].float() for token in ids[:-1]]
    stacked = torch.stack(causal)  # (L-1, vocab)
    bits_full = torch.nn.functional.cross_entropy(full, targets).item() / math.log(2)
    bits_causal = torch.nn.functional.cross_entropy(stacked, targets).item() / math.log(2)
    agree = (full.argmax(-1) == stacked.argmax(-1)).float().mean().item()
    return bits_full, bits_causal, agree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, default=REPO / "export" / "default_artifact")
    add_test_books_arg(p)
    p.add_argument("--lengths", type=lambda s: [int(n) for n in s.split(",")], default=[4096, 16384])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    art = load_artifact(args.artifact)
    if args.test_books is None:
        raise SystemExit("--test-books DIR: the test set's books")
    books = whole_books(args.test_books, art.tokenizer)
    rows = []
    began = time.perf_counter()
    for length in args.lengths:
        for name, book_ids in books:
            ids = [int(i) for i in book_ids[:length]]
            if len(ids) < length:
                continue
            text_bytes = len(art.tokenizer.decode(ids[1:]).encode())
            full, causal, agree = both_ways(art.model, ids)
            per_byte = (len(ids) - 1) / text_bytes  # tokens per byte: bits per token to bits per byte
            rows.append({"length": length, "book": name, "bpb_one_piece": full * per_byte,
                         "bpb_causal": causal * per_byte, "top1_agreement": agree})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    summary = []
    for length in args.lengths:
        mine = [r for r in rows if r["length"] == length]
        if not mine:
            continue
        one = sum(r["bpb_one_piece"] for r in mine) / len(mine)
        cau = sum(r["bpb_causal"] for r in mine) / len(mine)
        summary.append({"length": length, "books": len(mine), "bpb_one_piece": one, "bpb_causal": cau,
                        "relative_change": cau / one - 1,
                        "top1_agreement": sum(r["top1_agreement"] for r in mine) / len(mine)})
    out = {"artifact": str(args.artifact), "num_hashes": art.config.num_hashes, "test_books": str(args.test_books),
           "seconds": time.perf_counter() - began, "summary": summary, "rows": rows}
    path = args.out or REPO / "bench" / "results" / f"causal_quality_{datetime.date.today()}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'length':>7} {'books':>5} {'one-piece bpb':>14} {'causal bpb':>11} {'change':>8} {'top-1 agree':>12}")
    for s in summary:
        print(f"{s['length']:>7} {s['books']:>5} {s['bpb_one_piece']:>14.4f} {s['bpb_causal']:>11.4f} "
              f"{100 * s['relative_change']:>+7.2f}% {100 * s['top1_agreement']:>11.2f}%")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
