"""Training data: Gutenberg stripping, normalisation, the train/validation split, window sampling, and
the errors `reformer train` reports for bad data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from export.documents import DataError, clean_text, read_document
from model import ByteTokenizer
from train.data import WindowSampler, prepare_corpus, validation_windows
from train.loop import main as train_main

GUTENBERG = (
    "\ufeffThe Project Gutenberg EBook of Something\r\n"
    "Title: Something\r\n\r\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***\r\n\r\n"
    "Chapter 1\r\nIt was a dark night.\r\n\r\n"
    "End of the Project Gutenberg EBook of Something\r\n\r\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***\r\n"
    "Licence text that the model must never see.\r\n"
)


def test_gutenberg_header_licence_bom_and_crlf_are_removed() -> None:
    assert clean_text(GUTENBERG) == "Chapter 1\nIt was a dark night.\n"


def test_end_marker_without_end_of_line_and_plain_text_untouched() -> None:
    text = "*** START OF THE PROJECT GUTENBERG EBOOK X ***\nbody\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlegal"
    assert clean_text(text) == "body\n"
    plain = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    assert clean_text(plain) == plain
    assert clean_text("a\rb\r\nc") == "a\nb\nc\n"


def test_non_utf8_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt is not UTF-8"):
        read_document(bad)


def _write(tmp_path: Path, docs: dict[str, str]) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    for name, text in docs.items():
        (d / name).write_text(text, encoding="utf-8")
    return d


def test_split_holds_out_the_tail_of_every_document(tmp_path: Path) -> None:
    docs = {"a.txt": "a" * 950 + "b" * 50 + "\n", "b.txt": "c" * 1900 + "d" * 100 + "\n"}
    corpus = prepare_corpus([_write(tmp_path, docs)], tmp_path / "cache", val_fraction=0.05)
    tok = ByteTokenizer()
    for name, text in docs.items():
        ids = tok.encode(clean_text(text))
        head = next(s for s in corpus.train.segments if s.name == name)
        tail = next(s for s in corpus.val.segments if s.name == name)
        assert head.length + tail.length == len(ids)
        assert tail.length == round(len(ids) * 0.05)
        joined = np.concatenate([corpus.train.window(head.start, head.length),
                                 corpus.val.window(tail.start, tail.length)])
        assert joined.tolist() == ids  # the split loses and duplicates nothing
    # the cache is reused: a second call finds the same files
    again = prepare_corpus([tmp_path / "corpus"], tmp_path / "cache", val_fraction=0.05)
    assert again.cache_dir == corpus.cache_dir


def test_training_windows_never_contain_validation_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    docs = {f"d{i}.txt": "".join(rng.choice(list("abcdefgh \n"), size=400 + 300 * i)) for i in range(3)}
    corpus = prepare_corpus([_write(tmp_path, docs)], tmp_path / "cache", val_fraction=0.2)
    heads = [bytes((corpus.train.window(s.start, s.length) - 2).tolist()) for s in corpus.train.segments]
    sampler = WindowSampler(corpus.train, window=64, seed=3)
    for step in range(25):
        batch = sampler.global_batch(sampler.rng(step, 0), rows=4)
        assert batch.shape == (4, 65)
        for row in batch:
            # random text: a window reaching past a head into its tail (or into the next document)
            # is not a substring of any head
            assert any(bytes((row - 2).tolist()) in head for head in heads)


def test_window_sampling_is_a_function_of_seed_step_and_micro_step(tmp_path: Path) -> None:
    corpus = prepare_corpus([_write(tmp_path, {"a.txt": "lorem ipsum dolor " * 200})], tmp_path / "cache")
    s1, s2 = WindowSampler(corpus.train, 32, seed=5), WindowSampler(corpus.train, 32, seed=5)
    a = s1.global_batch(s1.rng(7, 1), 3)
    assert np.array_equal(a, s2.global_batch(s2.rng(7, 1), 3))
    assert not np.array_equal(a, s1.global_batch(s1.rng(8, 1), 3))


def test_validation_windows_predict_every_tail_byte_once(tmp_path: Path) -> None:
    corpus = prepare_corpus([_write(tmp_path, {"a.txt": "x" * 3000, "b.txt": "y" * 700})], tmp_path / "cache",
                            val_fraction=0.1)
    windows = validation_windows(corpus.val, window=64)
    predicted = sum(len(w) - 1 for w in windows)
    assert predicted == sum(s.length - 1 for s in corpus.val.segments)
    assert all(len(w) <= 65 for w in windows)
    subset = validation_windows(corpus.val, window=64, max_windows=2)
    assert len(subset) == 2 and all(any(np.array_equal(s, w) for w in windows) for s in subset)


def test_sampler_rejects_documents_shorter_than_the_window(tmp_path: Path) -> None:
    corpus = prepare_corpus([_write(tmp_path, {"a.txt": "short text"})], tmp_path / "cache")
    with pytest.raises(DataError, match="longer than the window"):
        WindowSampler(corpus.train, window=4096, seed=0)


TINY = ["--hidden-size", "32", "--num-heads", "2", "--attn-layers", "local,lsh", "--feed-forward-size", "64",
        "--chunk-length", "16", "--num-buckets", "4", "--axial-pos-shape", "16,64", "--max-positions", "1024",
        "--max-steps", "1", "--no-progress"]


@pytest.mark.parametrize("case,expected", [
    ("empty-dir", "corpus is empty"),
    ("blank-file", "the corpus is empty"),
    ("not-utf8", "bad.txt is not UTF-8"),
    ("window-too-long", "--window 2048 is longer than the model's max_position_embeddings 1024"),
    ("missing", "is neither a file nor a directory"),
])
def test_reformer_train_reports_bad_data_with_exit_code_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, expected: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    window = "64"
    if case == "blank-file":
        (data / "blank.txt").write_text("\n\n")
    elif case == "not-utf8":
        (data / "good.txt").write_text("fine text " * 50)
        (data / "bad.txt").write_bytes(b"\xff\xfe broken \x80")
    elif case == "window-too-long":
        (data / "good.txt").write_text("fine text " * 500)
        window = "2048"
    elif case == "missing":
        data = tmp_path / "nowhere"
    rc = train_main([str(data), "--out", str(tmp_path / "run"), "--window", window, *TINY])
    assert rc == 2
    err = capsys.readouterr().err
    assert "reformer train: error:" in err and expected in err
