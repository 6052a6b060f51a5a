"""`reformer data`: write the training corpus listed in train/corpus_manifest.py into its folder of the clone
(`corpus/`, git-ignored), where `reformer train` and the benchmarks read it by default.

    reformer data                                download every book: Project Gutenberg by ebook number
    reformer data --from DIR [DIR ...]           copy the books from local folders instead (found by file name)
    reformer data --sets data                    only the books of the named sets (data, corpus)
    reformer data --url-template URL             another server: {ebook} in URL is replaced by the number

Every file's sha256 is checked against the manifest before it is written (to a temporary name, renamed once it
matches): a file that differs is refused by name and not written, so a training run never reads a book other
than the one listed. A file already in place with the listed digest is kept, so a second run fetches only what
is missing. Each set folder gets a README.md with the digests, which `reformer train` checks again when it reads
the folder (train/corpus.py). Exit status 0 when every chosen book is in place, 1 otherwise."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from .corpus_manifest import CORPUS_ROOT, GUTENBERG_URL, SETS, Book, books_of, set_folder

TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Outcome:
    book: Book
    status: str  # "kept" (already in place), "written", "refused" (digest differs), "missing" (not found)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("kept", "written")


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def in_place(book: Book, root: Path) -> bool:
    path = set_folder(book.set, root) / book.name
    return path.is_file() and sha256_of(path.read_bytes()) == book.sha256


def place(book: Book, data: bytes, root: Path, origin: str) -> Outcome:
    """Write `data` as `book` when its digest is the listed one; refuse it, naming both digests, otherwise."""
    got = sha256_of(data)
    if got != book.sha256:
        return Outcome(book, "refused", f"{origin}: sha256 {got[:16]}... ({len(data):,} bytes), the manifest lists "
                                        f"{book.sha256[:16]}... ({book.size:,} bytes)")
    folder = set_folder(book.set, root)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{book.name}.part"
    tmp.write_bytes(data)
    os.replace(tmp, folder / book.name)  # a reader never sees a half-written book
    return Outcome(book, "written", origin)


def download_books(books: Sequence[Book], root: Path, client: httpx.Client,
                   template: str = GUTENBERG_URL) -> list[Outcome]:
    out = []
    for book in books:
        if in_place(book, root):
            out.append(Outcome(book, "kept"))
            continue
        url = book.source(template)
        try:
            response = client.get(url, follow_redirects=True, timeout=TIMEOUT_S)
        except httpx.HTTPError as e:
            out.append(Outcome(book, "missing", f"{url}: {type(e).__name__}: {e}"))
            continue
        if response.status_code != 200:
            out.append(Outcome(book, "missing", f"{url}: HTTP {response.status_code}"))
            continue
        out.append(place(book, response.content, root, url))
    return out


def copy_books(books: Sequence[Book], root: Path, sources: Sequence[Path]) -> list[Outcome]:
    """Each book from the first of `sources` (searched recursively) holding a file of its name."""
    found: dict[str, Path] = {}
    for folder in sources:
        if not folder.is_dir():
            raise FileNotFoundError(f"--from {folder}: not a directory")
        for path in sorted(folder.rglob("*.txt")):
            found.setdefault(path.name, path)
    out = []
    for book in books:
        if in_place(book, root):
            out.append(Outcome(book, "kept"))
        elif book.name not in found:
            out.append(Outcome(book, "missing", f"no file of that name under {', '.join(map(str, sources))}"))
        else:
            out.append(place(book, found[book.name].read_bytes(), root, str(found[book.name])))
    return out


def write_digest_lists(root: Path, books: Sequence[Book]) -> None:
    """Each set folder's README.md: its books' digests, as `sha256sum` prints them (train/corpus.py reads them)."""
    for name in sorted({b.set for b in books}):
        folder = set_folder(name, root)
        folder.mkdir(parents=True, exist_ok=True)
        lines = [f"# Corpus set `{name}`, written by `reformer data` from train/corpus_manifest.py", "",
                 "`reformer train` checks each file it reads from here against its digest:", "", "```"]
        lines += [f"{b.sha256}  {b.name}" for b in books if b.set == name]
        (folder / "README.md").write_text("\n".join([*lines, "```", ""]), encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reformer data", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="sources", type=Path, nargs="+", metavar="DIR",
                   help="copy the books from these folders (searched recursively) instead of downloading them")
    p.add_argument("--sets", default=",".join(SETS),
                   help=f"comma-separated named sets to write (default: {','.join(SETS)})")
    p.add_argument("--out", type=Path, default=CORPUS_ROOT,
                   help="the corpus folder (default: the clone's corpus/, or REFORMER_CORPUS_DIR; the trainer "
                        "reads the same default)")
    p.add_argument("--url-template", default=GUTENBERG_URL,
                   help="download URL with {ebook} for the ebook number (default: Project Gutenberg's)")
    return p


def main(argv: list[str] | None = None, client: httpx.Client | None = None) -> int:
    args = build_parser().parse_args(argv)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in SETS]
    if unknown or not sets:
        print(f"reformer data: unknown set(s) {unknown or [args.sets]}: use {', '.join(SETS)}", file=sys.stderr)
        return 2
    if "{ebook}" not in args.url_template:
        print(f"reformer data: --url-template {args.url_template!r} has no {{ebook}}", file=sys.stderr)
        return 2
    books = books_of(sets)
    if args.sources:
        try:
            outcomes = copy_books(books, args.out, args.sources)
        except FileNotFoundError as e:
            print(f"reformer data: {e}", file=sys.stderr)
            return 2
    else:
        with client or httpx.Client(headers={"User-Agent": "reformer-serve (reformer data)"}) as http:
            outcomes = download_books(books, args.out, http, args.url_template)
    write_digest_lists(args.out, books)
    for o in outcomes:
        where = set_folder(o.book.set, args.out) / o.book.name
        print(f"{o.status:<8} {where}" + (f"  ({o.detail})" if o.detail and not o.ok else ""))
    bad = [o for o in outcomes if not o.ok]
    print(f"{len(outcomes) - len(bad)} of {len(outcomes)} books in place under {args.out}")
    if bad:
        print("not written: " + ", ".join(f"{o.book.name} ({o.status})" for o in bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
