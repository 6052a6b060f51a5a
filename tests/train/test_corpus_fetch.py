"""`reformer data` (train/corpus_fetch.py): books downloaded by ebook number or copied from a folder, each checked
against the manifest's sha256 and refused by name when it differs; the trainer then reads and re-checks the
folder. The HTTP server is an httpx.MockTransport serving small texts made here (no network is reached)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import httpx
import pytest

from service.cli import SUBCOMMANDS
from train import corpus_fetch
from train.corpus import check_listed_digests
from train.corpus_fetch import copy_books, download_books, main
from train.corpus_manifest import BOOKS, GUTENBERG_URL, SETS, Book, set_folder
from train.data import DataError

TEXTS = {"alpha_pg11.txt": b"It was a bright cold day in April.\n" * 40,
         "beta_pg12.txt": b"Call me Ishmael. Some years ago.\n" * 50,
         "gamma.txt": b"First Citizen:\nBefore we proceed any further, hear me speak.\n" * 30}


def _book(name: str, set_: str = "data", ebook: int | None = None, url: str | None = None) -> Book:
    data = TEXTS[name]
    return Book(set_, name, ebook, len(data), hashlib.sha256(data).hexdigest(), url)


BOOKS_HERE = [_book("alpha_pg11.txt", ebook=11), _book("beta_pg12.txt", "corpus", ebook=12),
              _book("gamma.txt", url="https://example.org/texts/gamma.txt")]


class Server:
    """Serves TEXTS by ebook number at Project Gutenberg's URLs and gamma.txt at its own; records each request."""

    def __init__(self, texts: dict[str, bytes]) -> None:
        self.texts, self.requests = texts, list[str]()
        self.by_url = {GUTENBERG_URL.format(ebook=11): "alpha_pg11.txt", GUTENBERG_URL.format(ebook=12):
                       "beta_pg12.txt", "https://example.org/texts/gamma.txt": "gamma.txt"}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(str(request.url))
        name = self.by_url.get(str(request.url))
        return httpx.Response(404) if name is None else httpx.Response(200, content=self.texts[name])

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self))


def test_download_writes_each_book_into_its_set_folder(tmp_path: Path) -> None:
    server = Server(TEXTS)
    outcomes = download_books(BOOKS_HERE, tmp_path, server.client())
    assert [o.status for o in outcomes] == ["written"] * 3
    assert server.requests == ["https://www.gutenberg.org/cache/epub/11/pg11.txt",
                               "https://www.gutenberg.org/cache/epub/12/pg12.txt",
                               "https://example.org/texts/gamma.txt"]
    for book in BOOKS_HERE:
        assert (set_folder(book.set, tmp_path) / book.name).read_bytes() == TEXTS[book.name]
    assert not list(tmp_path.rglob(".*.part"))


def test_a_second_run_fetches_only_what_is_missing(tmp_path: Path) -> None:
    download_books(BOOKS_HERE, tmp_path, Server(TEXTS).client())
    (set_folder("corpus", tmp_path) / "beta_pg12.txt").unlink()
    server = Server(TEXTS)
    outcomes = download_books(BOOKS_HERE, tmp_path, server.client())
    assert [o.status for o in outcomes] == ["kept", "written", "kept"]
    assert server.requests == ["https://www.gutenberg.org/cache/epub/12/pg12.txt"]


def test_a_changed_download_is_refused_by_name_and_not_written(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    changed = {**TEXTS, "beta_pg12.txt": TEXTS["beta_pg12.txt"].replace(b"Ishmael", b"Ahab")}
    monkeypatch.setattr(corpus_fetch, "books_of", lambda sets: [b for b in BOOKS_HERE if b.set in sets])
    assert main(["--out", str(tmp_path)], client=Server(changed).client()) == 1
    assert not (set_folder("corpus", tmp_path) / "beta_pg12.txt").exists()
    assert (set_folder("data", tmp_path) / "alpha_pg11.txt").read_bytes() == TEXTS["alpha_pg11.txt"]
    out, err = capsys.readouterr()
    assert re.search(r"refused .*beta_pg12\.txt .*sha256", out)
    assert "not written: beta_pg12.txt (refused)" in err


def test_a_missing_download_is_named(tmp_path: Path) -> None:
    gone = Book("data", "delta_pg99.txt", 99, 10, "0" * 64)
    [outcome] = download_books([gone], tmp_path, Server(TEXTS).client())
    assert (outcome.status, outcome.detail) == ("missing", f"{GUTENBERG_URL.format(ebook=99)}: HTTP 404")


def test_from_a_folder_copies_the_listed_books_and_checks_them(tmp_path: Path) -> None:
    source = tmp_path / "books"
    (source / "nested").mkdir(parents=True)
    (source / "alpha_pg11.txt").write_bytes(TEXTS["alpha_pg11.txt"])
    (source / "nested" / "beta_pg12.txt").write_bytes(TEXTS["beta_pg12.txt"] + b"one more line\n")
    (source / "unlisted.txt").write_bytes(b"not in the manifest\n")
    root = tmp_path / "corpus"
    outcomes = copy_books(BOOKS_HERE, root, [source])
    assert {o.book.name: o.status for o in outcomes} == {
        "alpha_pg11.txt": "written", "beta_pg12.txt": "refused", "gamma.txt": "missing"}
    assert sorted(p.name for p in root.rglob("*.txt")) == ["alpha_pg11.txt"]


def test_from_through_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "books"
    source.mkdir()
    for name, data in TEXTS.items():
        (source / name).write_bytes(data)
    monkeypatch.setattr(corpus_fetch, "books_of", lambda sets: [b for b in BOOKS_HERE if b.set in sets])
    root = tmp_path / "corpus"
    assert main(["--from", str(source), "--sets", "data", "--out", str(root)]) == 0
    assert sorted(p.name for p in root.rglob("*.txt")) == ["alpha_pg11.txt", "gamma.txt"]
    assert main(["--from", str(tmp_path / "nowhere"), "--out", str(root)]) == 2
    assert main(["--sets", "novels", "--out", str(root)]) == 2
    assert main(["--url-template", "https://mirror.example/pg.txt", "--out", str(root)]) == 2


def test_the_trainer_rechecks_what_was_written(tmp_path: Path) -> None:
    """Each set folder's README.md lists the digests; train/corpus.py refuses a book changed after writing."""
    download_books(BOOKS_HERE, tmp_path, Server(TEXTS).client())
    corpus_fetch.write_digest_lists(tmp_path, BOOKS_HERE)
    files = sorted(tmp_path.rglob("*.txt"))
    check_listed_digests(files)
    (set_folder("data", tmp_path) / "gamma.txt").write_bytes(b"another text\n")
    with pytest.raises(DataError, match="gamma.txt: sha256"):
        check_listed_digests(files)


def test_the_manifest_lists_each_book_once_with_its_ebook_number() -> None:
    names = [b.name for b in BOOKS]
    assert len(names) == len(set(names)) == 21
    assert {b.set for b in BOOKS} == set(SETS)
    for book in BOOKS:
        assert re.fullmatch(r"[0-9a-f]{64}", book.sha256), book.name
        number = re.search(r"_pg(\d+)\.txt$", book.name)
        assert book.ebook == (int(number.group(1)) if number else None), book.name
        assert book.source().startswith("https://"), book.name


def test_reformer_data_is_a_subcommand() -> None:
    assert SUBCOMMANDS["data"][:2] == ("train.corpus_fetch", "main")
