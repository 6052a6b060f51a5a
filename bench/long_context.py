"""Long context measured: retrieval (passkey and copy documents) and bits per byte with and without distant text.

Bits per byte (the default, and `--bpb-passages` under `--retrieval`): of the last `--tail` bytes of
`--passage`-byte validation passages, given the whole passage before them vs given only the `--context` bytes
just before them. The Reformer's reason to exist: with distant text to look at, the long-context figure
should be lower.

    python bench/long_context.py MODEL [--books DIR ...] [--passage 16384] [--tail 1024]
                                 [--context 1024] [--max-passages 0] [--threads 2] [--out FILE.json.gz]

MODEL is an artifact directory (export/default_artifact) or a training checkpoint (runs/NAME/checkpoint).
Passages are cut, without overlap, from the held-out tail of every file (`--val-fraction`, as in
`reformer train`), so the model never trained on a byte of them; with `--test-books DIR`, from the whole
books of the test set instead (bench/unseen_books.py: books no model here trained on). In the short case the
first target byte sees exactly `--context` bytes before it, the last one `--context + tail - 1`.

The two cases score the same bytes at different positions (the end of the passage against the start of a
short input), so a third, the control, gives the short context at the passage's own positions (position
offset `passage - context - tail`): whole against control is the effect of distant text alone, control
against short that of the positions alone.

Retrieval (`--retrieval`): at each of `--lengths` bytes, `--trials` documents of each kind
(train/long_docs.py): passkey with prose filler and with the standard filler ("The grass is green...";
the standard prompt, a random five-digit key at a random depth; correct iff the five greedy bytes after
"The pass key is " are the key), and copy documents (a 140-byte passage, prose, the passage's first 60
bytes again; score = share of the next 80 greedy bytes equal to the passage's next 80) each beside its
control (the same document with the first occurrence replaced by other prose: what plain prediction
scores). Copy is also scored teacher-forced (the share of the 80 bytes whose argmax is right given the true
bytes before it), beside its control. Every document is exactly the length (prompt + answer), its prose cut
from the validation tails of `--books` (default: the project's two book folders, train/corpus.py), or with
`--test-books DIR` from the test set's whole books, keys, depths and places drawn from `--seed` (the test
set's from streams of their own: bench/unseen_books.py TEST_SET_STREAM). Asked three ways
(bench/long_context_ways.py): the forward pass (teacher-forced, or greedy over the prefix only), cached
decoding in process (greedy; teacher-forced by forced decode steps, which never see a later byte), and the
running service (greedy).

    python bench/long_context.py MODEL --retrieval [--lengths 1024,4096,16384,65536] [--trials 20]
        [--seed 0] [--ways forward,cached,service] [--forward-mode teacher] [--service-artifact DIR]
        [--port 0 | --url URL] [--bpb-passages 16384,65536] [--books DIR ... | --test-books DIR]
        [--out FILE.json.gz]

The result keeps every trial's record, so it is written gzip-compressed (bench/results_io.py) unless the
`--out` name ends in plain `.json`."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results_io import write_json  # noqa: E402
from bench.unseen_books import TEST_SET_STREAM, add_test_books_arg, describe, held_out_documents  # noqa: E402
from train.corpus import NAMED_SETS  # noqa: E402
from train.evaluation import add_passage_args, load_lm, nll_bits_of_last, passages  # noqa: E402
from train.long_docs import (  # noqa: E402
    LongDoc,
    copy_control,
    copy_document,
    passkey_document,
    random_key,
    standard_filler,
)


def measure(model_path: Path, data: list[str], passage: int, tail: int, context: int, val_fraction: float,
            max_passages: int, test_books: Path | None = None) -> dict[str, Any]:
    lm, tok = load_lm(model_path)
    cut = passages(held_out_documents(data, val_fraction, tok, test_books), passage)
    if max_passages:
        cut = cut[:max_passages]
    if not cut:
        where = "test book" if test_books is not None else "validation tail"
        raise SystemExit(f"long_context: no {where} holds a {passage}-byte passage; use a shorter --passage")
    per_book: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for name, ids in cut:
        full = nll_bits_of_last(lm, ids, tail)
        short = nll_bits_of_last(lm, ids[-(context + tail):], tail)
        control = nll_bits_of_last(lm, ids[-(context + tail):], tail, position_offset=len(ids) - context - tail)
        b = per_book.setdefault(name, {"passages": 0, "full_bits": 0.0, "short_bits": 0.0, "control_bits": 0.0})
        b["passages"] += 1
        b["full_bits"] += full
        b["short_bits"] += short
        b["control_bits"] += control
    rows: list[dict[str, Any]] = []
    for name, b in per_book.items():
        n = b["passages"] * tail
        rows.append({"book": name, "passages": int(b["passages"]), "bytes_scored": int(n),
                     "bpb_full_context": round(b["full_bits"] / n, 4),
                     "bpb_short_context": round(b["short_bits"] / n, 4),
                     "bpb_short_context_same_positions": round(b["control_bits"] / n, 4)})
    n_all = sum(r["bytes_scored"] for r in rows)
    total = {"book": "all", "passages": sum(r["passages"] for r in rows), "bytes_scored": n_all,
             "bpb_full_context": round(sum(b["full_bits"] for b in per_book.values()) / n_all, 4),
             "bpb_short_context": round(sum(b["short_bits"] for b in per_book.values()) / n_all, 4),
             "bpb_short_context_same_positions":
                 round(sum(b["control_bits"] for b in per_book.values()) / n_all, 4)}
    return {"benchmark": "long_context", "model": str(model_path), "passage_bytes": passage, "tail_bytes": tail,
            "short_context_bytes": context, **_documents_record(data, val_fraction, test_books),
            "rows": [*rows, total],
            "seconds": round(time.perf_counter() - t0, 1), "loadavg_1m": round(os.getloadavg()[0], 2)}


def table(result: dict[str, Any]) -> str:
    lines = [f"| book | passages | bytes scored | bpb, whole {result['passage_bytes']}-byte passage | "
             f"bpb, preceding {result['short_context_bytes']} bytes only | difference | "
             "control: those bytes at the passage's positions | whole - control |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        control = r["bpb_short_context_same_positions"]
        lines.append(f"| {r['book']} | {r['passages']} | {r['bytes_scored']:,} | {r['bpb_full_context']:.4f} | "
                     f"{r['bpb_short_context']:.4f} | {r['bpb_full_context'] - r['bpb_short_context']:+.4f} | "
                     f"{control:.4f} | {r['bpb_full_context'] - control:+.4f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- retrieval
COPY_PASSAGE, COPY_CUE, COPY_NEW = 140, 60, 80  # the cue then the 80 scored bytes
KINDS = ("passkey", "passkey_standard", "copy", "copy_control")


@dataclass(frozen=True)
class Trial:
    kind: str  # one of KINDS
    length: int
    index: int
    doc: LongDoc
    depth: float | None = None


def _documents_record(data: list[str], val_fraction: float, test_books: Path | None) -> dict[str, Any]:
    """What a result says it was measured on: the test set's books (names, sizes, digests; not the folder's
    path) or the folders whose validation tails were read."""
    if test_books is not None:
        return {"documents": "test set", "test_books": describe(test_books)}
    return {"documents": "validation tails", "data": [str(d) for d in data], "val_fraction": val_fraction}


def prose_pool(tails: list[tuple[str, np.ndarray]]) -> bytes:
    """The documents (validation tails, or the test set's whole books) end to end (a long document may cross
    from one book into the next), every
    non-ASCII byte made a space: a document is cut at arbitrary bytes (a copy document's prompt ends inside
    its passage), and the service takes text, so every cut must fall between two characters."""
    raw = b"\n\n".join((ids - 2).astype(np.uint8).tobytes() for _, ids in tails)
    return raw.translate(_ASCII_ONLY)


_ASCII_ONLY = bytes(b if b < 0x80 else 0x20 for b in range(256))


def make_trials(pool: bytes, length: int, trials: int, seed: int, stream: int | None = None) -> list[Trial]:
    """`trials` documents of each kind (KINDS) of `length` bytes, a pure function of (pool, length, trials,
    seed, stream); the standard-filler passkeys draw from their own generator, so the other documents are those
    an earlier version of this benchmark drew. A `stream` is prepended to every generator's key material: the
    test set's (TEST_SET_STREAM) draws keys, depths and places no validation-tail run drew at any seed."""
    if len(pool) < length + COPY_PASSAGE:
        raise SystemExit(f"long_context: {len(pool)} bytes of prose cannot hold a {length}-byte document")
    prefix = [] if stream is None else [stream]
    out: list[Trial] = []
    for i in range(trials):
        rng = np.random.default_rng([*prefix, seed, length, i])
        depth = float(rng.random())
        start = int(rng.integers(0, len(pool) - length + 1))
        out.append(Trial("passkey", length, i, passkey_document(pool[start:], random_key(rng), depth, length), depth))
        own = np.random.default_rng([*prefix, seed, length, i, 1])
        depth_s = float(own.random())
        doc_s = passkey_document(standard_filler(length), random_key(own), depth_s, length)
        out.append(Trial("passkey_standard", length, i, doc_s, depth_s))
        start = int(rng.integers(0, len(pool) - length + 1))
        doc = copy_document(pool[start:], COPY_PASSAGE, length - 2 * COPY_PASSAGE, COPY_CUE)
        other = int(rng.integers(0, len(pool) - COPY_PASSAGE + 1))
        out += [Trial("copy", length, i, doc), Trial("copy_control", length, i, copy_control(doc, pool[other:]))]
    return out


def passkey_correct(generated: bytes, key: bytes) -> bool:
    """The first five generated bytes are the key (what follows them does not matter)."""
    return generated[:len(key)] == key


def copy_score(generated: bytes, target: bytes) -> float:
    """Share of the target's bytes matched at the same offset by the generated bytes (missing ones miss)."""
    if not target:
        raise ValueError("empty copy target")
    return sum(1 for g, t in zip(generated, target, strict=False) if g == t) / len(target)


def score(kind: str, generated: bytes, expected: bytes) -> float:
    if kind.startswith("passkey"):
        return float(passkey_correct(generated, expected))
    return copy_score(generated, expected)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a proportion k / n (20 trials leave wide bounds: report them)."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lo, hi = (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)
    return (max(lo, 0.0), min(hi, 1.0))  # clamped: rounding leaves -1e-17 at k = 0


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 4) if values else None


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 4)


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (length, way): passkey k/n with its interval for each filler, mean greedy copy score
    beside its control, the teacher-forced copy share beside its control (where the way has one), and the
    differences (what the earlier passage adds)."""
    rows = []
    for length, way in dict.fromkeys((r["length"], r["way"]) for r in records):
        mine = [r for r in records if r["length"] == length and r["way"] == way]
        by = {k: [r["score"] for r in mine if r["kind"] == k] for k in KINDS}
        teach = {k: [r["teacher"] for r in mine if r["kind"] == k and r.get("teacher") is not None]
                 for k in ("copy", "copy_control")}
        row: dict[str, Any] = {"length": length, "way": way}
        for kind, name in (("passkey", "passkey"), ("passkey_standard", "passkey_standard")):
            k, n = int(sum(by[kind])), len(by[kind])
            lo, hi = wilson(k, n) if n else (0.0, 1.0)
            row.update({f"{name}_correct": k, f"{name}_trials": n, f"{name}_accuracy": round(k / n, 4) if n else None,
                        f"{name}_95ci": [round(lo, 3), round(hi, 3)]})
        copy, control = _mean(by["copy"]), _mean(by["copy_control"])
        t_copy, t_control = _mean(teach["copy"]), _mean(teach["copy_control"])
        row.update({"copy_score": copy, "copy_control": control, "copy_minus_control": _minus(copy, control),
                    "copy_teacher": t_copy, "copy_teacher_control": t_control,
                    "copy_teacher_minus_control": _minus(t_copy, t_control),
                    "seconds": round(sum(r["seconds"] for r in mine), 1)})
        rows.append(row)
    return rows


def _f(v: float | None, sign: bool = False) -> str:
    return "-" if v is None else f"{v:+.3f}" if sign else f"{v:.3f}"


def retrieval_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| bytes | way | passkey, prose filler | passkey, standard filler | copy, greedy | control | "
             "copy - control | copy, teacher-forced | control | seconds |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['length']:,} | {r['way']} | {r['passkey_correct']}/{r['passkey_trials']} "
                     f"| {r['passkey_standard_correct']}/{r['passkey_standard_trials']} "
                     f"| {_f(r['copy_score'])} | {_f(r['copy_control'])} | {_f(r['copy_minus_control'], True)} "
                     f"| {_f(r['copy_teacher'])} | {_f(r['copy_teacher_control'])} | {r['seconds']} |")
    if any(r["way"] == "forward (teacher)" for r in rows):
        lines.append("\nforward (teacher): one forward over the prompt and the expected bytes; the passkey columns are "
                     "greedy exact match (all five argmaxes right), the copy greedy columns the teacher-forced "
                     "share, not generated copies.")
    return "\n".join(lines)


def run_trials(ways: list[Any], trials: list[Trial]) -> list[dict[str, Any]]:
    records = []
    for way in ways:
        for t in trials:
            t0 = time.perf_counter()
            expected = t.doc.answer_bytes
            got = way.answer(t.doc.prompt, expected)
            forced = way.teacher(t.doc.prompt, expected) if t.kind.startswith("copy") else None
            teacher = None if forced is None else copy_score(forced, expected)
            records.append({"length": t.length, "way": way.name, "kind": t.kind, "index": t.index,
                            "depth": None if t.depth is None else round(t.depth, 4), "gap": t.doc.gap,
                            "expected": expected.decode("utf-8", "replace"),
                            "got": got.decode("utf-8", "replace"), "score": score(t.kind, got, expected),
                            "teacher": teacher, "seconds": round(time.perf_counter() - t0, 3)})
        print(f"  {way.name}: done", file=sys.stderr)
    return records


def retrieval(args: argparse.Namespace) -> dict[str, Any]:
    from bench.long_context_ways import CachedWay, ForwardWay, ServiceWay, running_service
    from model.decoding.runtime import tune_cpu_runtime

    tune_cpu_runtime()  # the decoder's CPU settings, as `reformer serve` runs
    lm, tok = load_lm(args.model)
    pool = prose_pool(held_out_documents(args.data, args.val_fraction, tok, args.test_books))
    stream = TEST_SET_STREAM if args.test_books is not None else None
    trials = [t for length in args.lengths for t in make_trials(pool, length, args.trials, args.seed, stream)]
    ways: list[Any] = []
    if "forward" in args.ways:
        ways.append(ForwardWay(lm, args.forward_mode))
    if "cached" in args.ways:
        ways.append(CachedWay(lm))
    t0 = time.perf_counter()
    records = run_trials(ways, trials)
    served = args.service_artifact or (args.model if (args.model / "manifest.json").exists() else None)
    service_note = None
    if "service" in args.ways and args.url:
        records += run_trials([ServiceWay(args.url)], trials)
    elif "service" in args.ways and served is not None:
        log = Path(tempfile.gettempdir()) / "reformer-long-context-service.log"
        print(f"service log: {log}", file=sys.stderr)
        with running_service(served, args.port, log, args.threads, max(COPY_NEW, 8)) as url:
            records += run_trials([ServiceWay(url)], trials)
    elif "service" in args.ways:
        service_note = "skipped: MODEL is a checkpoint; give --service-artifact or --url"
    bpb = []
    for passage in args.bpb_passages:
        bpb.append(measure(args.model, args.data, passage, 1024, 1024, args.val_fraction, args.max_passages,
                           args.test_books))
    rows = summarize(records)
    return {"benchmark": "long_context_retrieval", "model": str(args.model),
            **_documents_record(args.data, args.val_fraction, args.test_books),
            "lengths": args.lengths, "trials": args.trials, "seed": args.seed,
            "forward_mode": args.forward_mode, "service": service_note, "copy": {
                "passage": COPY_PASSAGE, "cue": COPY_CUE, "scored": COPY_NEW},
            "rows": rows, "bits_per_byte": bpb, "records": records, "threads": args.threads,
            "seconds": round(time.perf_counter() - t0, 1), "loadavg_1m": round(os.getloadavg()[0], 2)}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_passage_args(p, passage=16384, out=ROOT / "bench" / "results" / "long_context.json.gz")
    p.add_argument("--books", dest="data", nargs="+", metavar="DIR",
                   help="folders (or files) of books whose validation tails are read (the same as --data); "
                        "default: the project's book folders (train/corpus.py): both with --retrieval, the "
                        "three books without")
    add_test_books_arg(p)
    p.set_defaults(data=None, out=None)  # defaults below depend on --retrieval
    p.add_argument("--tail", type=int, default=1024)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-passages", type=int, default=0, help="0: every passage")
    r = p.add_argument_group("retrieval")
    r.add_argument("--retrieval", action="store_true", help="passkey and copy retrieval, three ways")
    r.add_argument("--lengths", type=_ints, default=[1024, 4096, 16384, 65536], help="document bytes")
    r.add_argument("--trials", type=int, default=20, help="passkey and copy documents per length (each)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--ways", type=lambda s: s.split(","), default=["forward", "cached", "service"])
    r.add_argument("--forward-mode", choices=["teacher", "greedy"], default="teacher",
                   help="full forward: teacher-forced argmax (one forward) or greedy, one forward per byte")
    r.add_argument("--service-artifact", type=Path, help="artifact to serve (default: MODEL when an artifact)")
    r.add_argument("--port", type=int, default=0, help="the service's port (0: a free one)")
    r.add_argument("--url", help="a running service to ask instead of starting one")
    r.add_argument("--bpb-passages", type=_ints, default=[16384, 65536],
                   help="passage lengths for bits per byte of the last 1,024 bytes, whole vs preceding 1,024")
    args = p.parse_args(argv)
    if args.test_books is not None and args.data is not None:
        p.error("--test-books reads the test set's whole books in place of --books/--data: give one of them")
    if args.data is None:
        names = ("data", "corpus") if args.retrieval else ("data",)
        args.data = [str(NAMED_SETS[n]) for n in names]
    if args.out is None:
        name = "long_context_retrieval.json.gz" if args.retrieval else "long_context.json.gz"
        args.out = ROOT / "bench" / "results" / name
    torch.set_num_threads(args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.retrieval:
        result = retrieval(args)
        result["table"] = retrieval_table(result["rows"])
        print(result["table"])
        for b in result["bits_per_byte"]:
            print(f"\n{b['passage_bytes']:,}-byte passages:\n{table(b)}")
    else:
        if args.tail + args.context > args.passage:
            p.error("--tail + --context must fit in --passage")
        result = measure(args.model, args.data, args.passage, args.tail, args.context, args.val_fraction,
                         args.max_passages, args.test_books)
        result["table"] = table(result)
        print(result["table"])
    write_json(args.out, result)  # per-trial records: gzip-compressed when the name ends in .gz
    print(f"\nwrote {args.out} ({result['seconds']} s, load {result['loadavg_1m']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
