"""bench/unseen_books.py and the `--test-books DIR` flag of bench/long_context.py, bench/val_bpb.py and
bench/quality/embed_quality.py, on a temporary folder of small fake Gutenberg books: each book read whole and
cleaned as the trainer cleans one, its digest checked, fresh keys drawn, and the result naming the books, not
the folder."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.long_context import make_trials, prose_pool
from bench.unseen_books import TEST_SET_STREAM, books_folder, held_out_documents, whole_books
from model import ByteTokenizer
from train.data import DataError

ROOT = Path(__file__).resolve().parents[2]
for folder in ("bench", "bench/quality"):  # the scripts import as their command line runs them
    sys.path.insert(0, str(ROOT / folder))

import embed_quality  # noqa: E402
import long_context  # noqa: E402
import val_bpb  # noqa: E402

TOK = ByteTokenizer()
BODY_BYTES = 3100  # each fake book's text between its Gutenberg header and licence, its final newline included


def gutenberg(title: str, body: str) -> str:
    return (f"The Project Gutenberg EBook of {title}\nRelease Date: 2026\n\n"
            f"*** START OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n\n{body}\n\n"
            f"*** END OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\nLICENCE TEXT OF THE PROJECT\n")


def _body(letters: str, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list(letters), size=BODY_BYTES - 1))  # + the newline clean_text ends it with


@pytest.fixture()
def books(tmp_path: Path) -> Path:
    """Two fake test books whose letters no training book below uses, and a README listing their digests."""
    folder = tmp_path / "unseen"
    folder.mkdir()
    for i, (name, letters) in enumerate((("klm.txt", "klmno "), ("xyz.txt", "XYZQJ "))):
        (folder / name).write_text(gutenberg(name[:3], _body(letters, i)))
    rows = "".join(f"| {f.name} | {f.stat().st_size} | {hashlib.sha256(f.read_bytes()).hexdigest()[:16]} |\n"
                   for f in sorted(folder.glob("*.txt")))
    (folder / "README.md").write_text("| file | bytes | sha256 (first 16) |\n|---|---:|---|\n" + rows)
    return folder


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    """Three training books of other letters (the validation-tail runs' text)."""
    folder = tmp_path / "data"
    folder.mkdir()
    rng = np.random.default_rng(9)
    for name, letters in (("aaa", "abcde fgh\n"), ("bbb", "pqrstu vw\n"), ("ccc", "KLMNOP R\n")):
        (folder / f"{name}.txt").write_text("".join(rng.choice(list(letters), size=4000)))
    return folder


def test_each_book_is_read_whole_without_its_gutenberg_header_and_licence(books: Path, data: Path) -> None:
    docs = whole_books(books, TOK)
    assert [name for name, _ in docs] == ["klm.txt", "xyz.txt"]
    for (name, ids), letters in zip(docs, ("klmno \n", "XYZQJ \n"), strict=True):
        text = (ids - 2).astype(np.uint8).tobytes().decode()
        assert len(ids) == BODY_BYTES and set(text) <= set(letters), name  # nothing of the header or licence
    assert held_out_documents([data], 0.5, TOK, books)[0][1].tolist() == docs[0][1].tolist()
    tails = held_out_documents([data], 0.5, TOK, None)  # without the flag: the validation tails, as before
    assert [name for name, _ in tails] == ["aaa.txt", "bbb.txt", "ccc.txt"] and len(tails[0][1]) == 2000


def test_a_book_that_differs_from_its_listed_digest_is_refused(books: Path) -> None:
    with (books / "xyz.txt").open("a") as f:
        f.write("one more line\n")
    with pytest.raises(DataError, match="xyz.txt: sha256"):
        whole_books(books, TOK)


def test_a_book_with_no_text_inside_its_gutenberg_markers_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text(gutenberg("empty", ""))
    with pytest.raises(DataError, match="empty.txt"):
        whole_books(tmp_path, TOK)


def test_the_flag_wants_a_folder_of_books(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a directory"):
        books_folder(str(tmp_path / "missing"))
    (tmp_path / "notes.md").write_text("no books here")
    with pytest.raises(argparse.ArgumentTypeError, match="holds no .txt books"):
        books_folder(str(tmp_path))
    for main in (long_context.main, val_bpb.main, embed_quality.main):
        with pytest.raises(SystemExit) as e:
            main(["model", "--test-books", str(tmp_path / "missing")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--test-books" in err and "is not a directory" in err


def test_test_set_keys_are_fresh_and_the_validation_ones_unchanged(books: Path) -> None:
    pool = prose_pool(whole_books(books, TOK))
    assert set(pool) <= set(b"klmnoXYZQJ \n")
    for seed in (0, 1):
        valid, test = make_trials(pool, 512, 4, seed), make_trials(pool, 512, 4, seed, TEST_SET_STREAM)
        for kind in ("passkey", "passkey_standard"):
            keys = [t.doc.answer_bytes for t in valid if t.kind == kind]
            fresh = [t.doc.answer_bytes for t in test if t.kind == kind]
            assert not set(keys) & set(fresh), (seed, kind)
        assert make_trials(pool, 512, 4, seed) == valid  # still a pure function of its arguments
        rng = np.random.default_rng([seed, 512, 0])  # a validation trial's generator, as earlier versions drew it
        assert valid[0].depth == float(rng.random())


def test_long_context_measures_the_test_books_and_names_them_not_their_folder(
        tiny_artifact: Path, books: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lc.json"
    assert long_context.main([str(tiny_artifact), "--retrieval", "--test-books", str(books), "--lengths", "512",
                              "--trials", "2", "--ways", "forward", "--bpb-passages", "1536", "--threads", "1",
                              "--out", str(out)]) == 0
    text = out.read_text()
    res = json.loads(text)
    assert res["documents"] == "test set" and "data" not in res and str(books) not in text
    assert res["test_books"] == [{"file": f.name, "bytes": f.stat().st_size,
                                  "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                                 for f in sorted(books.glob("*.txt"))]
    trials = make_trials(prose_pool(whole_books(books, TOK)), 512, 2, 0, TEST_SET_STREAM)
    assert [r["expected"] for r in res["records"]] == [t.doc.answer_bytes.decode() for t in trials]
    bpb = res["bits_per_byte"][0]
    assert bpb["documents"] == "test set" and bpb["rows"][-1]["passages"] == 2 * (BODY_BYTES // 1536)
    assert {r["book"] for r in bpb["rows"][:-1]} == {"klm.txt", "xyz.txt"}
    with pytest.raises(SystemExit) as e:
        long_context.main([str(tiny_artifact), "--books", str(data), "--test-books", str(books)])
    assert e.value.code == 2 and "give one of them" in capsys.readouterr().err


def test_val_bpb_scores_every_byte_of_each_whole_test_book(
        tiny_artifact: Path, books: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "v.json"
    assert val_bpb.main([str(tiny_artifact), "--test-books", str(books), "--window", "300", "--threads", "1",
                         "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["documents"] == "test set" and [g["folder"] for g in res["groups"]] == ["test set"]
    # 3,100 bytes a book in windows of 300: 11 windows, each scoring all but its first byte
    assert [(f["file"], f["bytes"]) for f in res["groups"][0]["files"]] == [("klm.txt", 3089), ("xyz.txt", 3089)]
    assert 0 < res["groups"][0]["bits_per_byte"] < 16 and str(books) not in out.read_text()
    with pytest.raises(SystemExit) as e:
        val_bpb.main([str(tiny_artifact), "--data", str(data), "--test-books", str(books)])
    assert e.value.code == 2 and "give one" in capsys.readouterr().err


def test_embed_quality_identifies_test_books_with_statistics_of_the_training_heads(
        tiny_artifact: Path, books: Path, data: Path, tmp_path: Path) -> None:
    out = tmp_path / "eq.json"
    assert embed_quality.main([str(tiny_artifact), "--test-books", str(books), "--data", str(data),
                               "--val-fraction", "0.5", "--passage", "100", "--per-book", "6",
                               "--stats-passages", "30", "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["documents"] == "test set" and res["per_book"] == {"klm.txt": 6, "xyz.txt": 6}
    assert [b["file"] for b in res["test_books"]] == ["klm.txt", "xyz.txt"]
    # the standardised and whitened rows' statistics: 10 passages of each training book's 2,000-byte head
    assert res["stats_per_book"] == {"aaa.txt": 10, "bbb.txt": 10, "ccc.txt": 10}
    assert res["rows"][0]["accuracy"] == 1.0  # disjoint letters: counting bytes identifies every passage
