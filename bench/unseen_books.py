"""The test set: whole books that no model here trained on, given to a quality benchmark with
`--test-books DIR` (bench/long_context.py, bench/val_bpb.py, bench/quality/embed_quality.py) in place of the
training books' held-out validation tails. Every byte of such a book is held out, so each book is read whole,
cleaned of its Project Gutenberg header and licence exactly as the trainer cleans a training book
(export/documents.py), and where the folder's README.md lists a book's sha256 the file must match it
(train/corpus.py), so a figure is never taken on a silently changed book.

The folder is not part of the repository: a result file records each book's name, size and digest, not the
folder's path."""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from model.tokenizer import Tokenizer
from train.corpus import check_listed_digests
from train.data import DataError, find_text_files, read_document
from train.evaluation import validation_tails

# Prepended to a test-set document's random-number key material, so its pass keys, depths and places are drawn
# from streams no validation-tail run used, whatever --seed is (a validation-tail run's key material has no
# prefix, so its documents stay those earlier versions of the benchmark drew). The bytes of "test".
TEST_SET_STREAM = int.from_bytes(b"test", "big")

HELP = ("a folder of whole books no model trained on (the test set), read in place of the training books' "
        "validation tails: each book whole, its Project Gutenberg header and licence removed, checked against "
        "the sha256 digests the folder's README.md lists")


def books_folder(text: str) -> Path:
    """argparse type of `--test-books`: a directory holding at least one .txt book."""
    folder = Path(text)
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not any(f.is_file() and f.suffix == ".txt" for f in folder.iterdir()):
        raise argparse.ArgumentTypeError(f"{text!r} holds no .txt books")
    return folder


def add_test_books_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--test-books", type=books_folder, metavar="DIR", help=HELP)


def whole_books(folder: Path, tokenizer: Tokenizer) -> list[tuple[str, np.ndarray]]:
    """(file name, token ids) of every whole book in `folder`, in name order, digests checked."""
    files = find_text_files([folder])
    check_listed_digests(files)
    out = [(f.name, np.asarray(tokenizer.encode(read_document(f)), dtype=np.int64)) for f in files]
    empty = [name for name, ids in out if len(ids) == 0]
    if empty:
        raise DataError(f"test books with no text after the Gutenberg header and licence are removed: {empty}")
    return out


def held_out_documents(data: Sequence[str | Path], val_fraction: float, tokenizer: Tokenizer,
                       test_books: Path | None) -> list[tuple[str, np.ndarray]]:
    """What a quality benchmark scores: the test set's whole books when given, else the validation tails of
    `data` (train/evaluation.py, cut as `reformer train` cuts them)."""
    if test_books is not None:
        return whole_books(test_books, tokenizer)
    return validation_tails(data, val_fraction, tokenizer)


def describe(folder: Path) -> list[dict[str, Any]]:
    """Each book's file name, size in bytes and sha256, for a result file (the folder's path is left out)."""
    return [{"file": f.name, "bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
            for f in find_text_files([folder])]
