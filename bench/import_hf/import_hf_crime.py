"""`reformer import-hf` of a checkpoint with google/reformer-crime-and-punishment's exact configuration (random
weights) and a SentencePiece tokenizer of its size, timed; and the refusal of a corrupted tokenizer and of one
of the wrong size.

    python bench/import_hf/import_hf_crime.py --book BOOK.txt [--work /tmp/import_hf_crime] [--limit 180]
                                    [--variants default,no-onnx] [--out bench/results/import_hf_crime.json]

The checkpoint is transformers.ReformerConfig with crime-and-punishment's values, torch.manual_seed(8),
ReformerModelWithLMHead(cfg).save_pretrained, beside a spiece.model of 320 pieces trained on --book (a plain
text file: the real model's vocabulary was trained on the novel), unless --work already holds them. Each
variant runs `python -m service.cli import-hf CKPT OUT FLAGS` through bench/import_hf/import_hf_enwik8.py's `timed`
(nice, /usr/bin/time -v, timeout --limit); the damaged copies are the checkpoint with its spiece.model cut to
a third, and with a SentencePiece model of 300 pieces.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the tree's packages are importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.import_hf.import_hf_enwik8 import ROOT, timed  # noqa: E402

FLAGS = {"default": [], "no-onnx": ["--no-onnx"], "skip-parity": ["--skip-parity"]}
CRIME_AND_PUNISHMENT: dict[str, Any] = dict(
    vocab_size=320, hidden_size=256, num_attention_heads=2, attention_head_size=64,
    attn_layers=["local", "lsh", "local", "lsh", "local", "lsh"], feed_forward_size=512, hidden_act="relu",
    num_hashes=1, num_buckets=[64, 128], lsh_attn_chunk_length=64, local_attn_chunk_length=64,
    lsh_num_chunks_before=1, lsh_num_chunks_after=0, local_num_chunks_before=1, local_num_chunks_after=0,
    axial_pos_embds=True, axial_pos_shape=[512, 1024], axial_pos_embds_dim=[64, 192],
    max_position_embeddings=524288, hash_seed=None, hidden_dropout_prob=0.05,
    lsh_attention_probs_dropout_prob=0.0, local_attention_probs_dropout_prob=0.05, is_decoder=True,
    eos_token_id=2, pad_token_id=0, chunk_size_lm_head=0, chunk_size_feed_forward=0)


def train_sentencepiece(text_lines: Any, vocab_size: int) -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=text_lines, model_writer=buf, vocab_size=vocab_size,
                                   character_coverage=1.0, minloglevel=2, num_threads=2)
    return buf.getvalue()


def book_lines(book: Path) -> Any:
    return iter([line for line in book.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()])


def build_checkpoint(directory: Path, book: Path) -> Path:
    if (directory / "model.safetensors").is_file() and (directory / "spiece.model").is_file():
        return directory
    import torch
    import transformers

    torch.manual_seed(8)
    transformers.ReformerModelWithLMHead(transformers.ReformerConfig(**CRIME_AND_PUNISHMENT)).save_pretrained(
        str(directory))
    (directory / "spiece.model").write_bytes(train_sentencepiece(book_lines(book), 320))
    return directory


def damaged_copies(ckpt: Path, work: Path, book: Path) -> dict[str, Path]:
    out = {}
    for name in ("tokenizer-corrupted", "tokenizer-300-pieces"):
        d = work / f"ckpt-{name}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(ckpt, d)
        sp = d / "spiece.model"
        if name == "tokenizer-corrupted":
            sp.write_bytes(sp.read_bytes()[: sp.stat().st_size // 3])
        else:
            sp.write_bytes(train_sentencepiece(book_lines(book), 300))
        out[name] = d
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--book", type=Path, required=True, help="a plain-text book to train the 320-piece tokenizer on")
    p.add_argument("--work", type=Path, default=Path("/tmp/import_hf_crime"))
    p.add_argument("--limit", type=int, default=180, help="seconds after which a run is stopped")
    p.add_argument("--variants", default="default", help=f"comma-separated, of {', '.join(FLAGS)}")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "import_hf_crime.json")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    ckpt = build_checkpoint(args.work / "ckpt", args.book)
    result: dict[str, Any] = {
        "checkpoint": {"config": CRIME_AND_PUNISHMENT, "seed": 8,
                       "built_with": "ReformerModelWithLMHead(cfg).save_pretrained",
                       "tokenizer": f"spiece.model: SentencePiece unigram, 320 pieces, trained on {args.book.name}",
                       "weights_bytes": (ckpt / "model.safetensors").stat().st_size,
                       "build_s": round(time.monotonic() - start, 1)},
        "machine": {"note": "two cores shared with other sessions; load averages per run"},
        "bench_command": " ".join(["python", *sys.argv]),
        "commit": subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                 text=True).stdout.strip(),
        "runs": {}, "damaged": {}}
    for variant in args.variants.split(","):
        out = args.work / f"art-{variant}"
        shutil.rmtree(out, ignore_errors=True)
        run = timed(["import-hf", str(ckpt), str(out), *FLAGS[variant]], args.limit)
        manifest = out / "manifest.json"
        if run["exit_status"] == 0 and manifest.is_file():
            m = json.loads(manifest.read_text())
            run["parity"] = m["evaluation"]["transformers_parity"]
            run["tokenizer"] = m["provenance"].get("tokenizer")
            run["artifact_files"] = sorted(m["files"])
            onnx = m.get("export", {}).get("onnx")
            if onnx:
                run["onnx"] = {k: onnx.get(k) for k in ("export_seconds", "optimized", "verification", "max_abs_diff")}
        result["runs"][variant] = run
        print(variant, {k: run[k] for k in ("exit_status", "wall_s", "peak_rss_mb")}, flush=True)
    for name, d in damaged_copies(ckpt, args.work, args.book).items():
        run = timed(["import-hf", str(d), str(args.work / f"art-{name}"), "--no-onnx"], args.limit)
        run["refused"] = run["exit_status"] == 1 and not (args.work / f"art-{name}").exists()
        result["damaged"][name] = run
        print(name, {k: run[k] for k in ("exit_status", "wall_s", "refused")}, run["log_tail"][-1:], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
