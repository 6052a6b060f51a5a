"""Long documents for the load test, cut from a directory of text files (books).

Each document starts at a chapter (or, failing that, a paragraph) and runs over whole consecutive chapters;
the last one is cut where the requested byte length runs out, at a chapter, paragraph, line or character
boundary in that order, so every document is between `min_fill` x N and N UTF-8 bytes long and never splits
a multi-byte character. Project Gutenberg licence headers and footers are stripped. Symbolic links are
followed, to files and to directories, wherever they point (a directory of links to books is the usual way to
pick a few); each file is read once, and a link back up the tree does not loop.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".text")

# Gutenberg boilerplate: everything up to the "*** START OF ..." line, and from the "*** END OF ..." or
# "End of (the) Project Gutenberg ..." line on (DESIGN/data README: ~19 KB of licence text at the end).
_GUTENBERG_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(
    r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.I | re.M
)
# Headings that open a chapter-like unit in the books users are likely to point this at.
# Upper-case keywords, or a capitalised one followed by a number, alone on a short line ("Part of the
# army..." in prose must not count).
_HEADING = re.compile(
    rb"^(?:(?:CHAPTER|BOOK|PART|ACT|EPILOGUE)\b[^\n]{0,60}"
    rb"|(?:Chapter|Book|Part|Act) (?:\d+|[IVXLC]+)\b[^\n]{0,40})$",
    re.M,
)
# Two headings this close together ("BOOK ONE" then "CHAPTER I") open one unit, not two.
_HEADING_MERGE_BYTES = 400


class DocumentError(ValueError):
    """The directory cannot supply documents of the requested length."""


@dataclass(frozen=True)
class Document:
    source: str  # file the document starts in (relative to the documents directory)
    text: str
    # sent as `cache_prefix_chars`: the text's first N characters are the part the server keeps and reuses
    cache_prefix_chars: int | None = None

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def strip_gutenberg(text: str) -> str:
    """The book without Project Gutenberg's header and licence footer; other text is returned unchanged."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def normalise(text: str) -> str:
    return text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").strip("\n") + "\n"


def text_files(docs_dir: Path) -> list[Path]:
    """Text files under docs_dir, links followed, sorted by their path under docs_dir; each real file once."""
    root = docs_dir.absolute()
    if not root.is_dir():
        raise DocumentError(f"--docs {docs_dir}: not a directory")
    files: list[Path] = []
    seen_files: set[Path] = set()
    seen_dirs: set[Path] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real_dir = Path(dirpath).resolve()
        if real_dir in seen_dirs:  # a link back up the tree (or a second link to one directory)
            dirnames.clear()
            continue
        seen_dirs.add(real_dir)
        dirnames.sort()  # the first link to a directory (in name order) names its files
        for name in filenames:
            path = Path(dirpath) / name
            real = path.resolve()
            if path.suffix.lower() in TEXT_SUFFIXES and real.is_file() and real not in seen_files:
                seen_files.add(real)
                files.append(path)
    if not files:
        raise DocumentError(f"--docs {docs_dir}: no text files ({', '.join(TEXT_SUFFIXES)})")
    return sorted(files)


@dataclass(frozen=True)
class _Corpus:
    data: bytes  # all files, cleaned, concatenated
    unit_starts: list[int]  # byte offsets where a chapter (or file) begins
    paragraph_starts: list[int]
    sources: list[tuple[int, str]]  # (byte offset where a file begins, its relative name)

    def source_at(self, offset: int) -> str:
        name = self.sources[0][1]
        for start, source in self.sources:
            if start > offset:
                break
            name = source
        return name


def _load_corpus(docs_dir: Path) -> _Corpus:
    root = docs_dir.absolute()
    parts: list[bytes] = []
    unit_starts: list[int] = []
    paragraph_starts: list[int] = []
    sources: list[tuple[int, str]] = []
    offset = 0
    for path in text_files(docs_dir):
        text = normalise(strip_gutenberg(path.read_text(encoding="utf-8", errors="replace")))
        data = text.encode("utf-8")
        sources.append((offset, str(path.relative_to(root))))
        last = -_HEADING_MERGE_BYTES
        for start in [0] + [m.start() for m in _HEADING.finditer(data)]:
            if start - last >= _HEADING_MERGE_BYTES:
                unit_starts.append(offset + start)
                last = start
        paragraph_starts.extend(offset + m.end() for m in re.finditer(rb"\n\n+", data))
        parts.append(data + b"\n")
        offset += len(data) + 1
    return _Corpus(b"".join(parts), sorted(set(unit_starts)), paragraph_starts, sources)


def _char_boundary(data: bytes, end: int) -> int:
    """The largest end' <= end that does not split a UTF-8 character (continuation bytes are 10xxxxxx)."""
    while end > 0 and end < len(data) and (data[end] & 0xC0) == 0x80:
        end -= 1
    return end


def _cut_end(corpus: _Corpus, start: int, nbytes: int, min_fill: float) -> int:
    """Where a document starting at `start` ends: the best boundary within [start + min_fill*N, start + N]."""
    limit = min(start + nbytes, len(corpus.data))
    floor = start + int(min_fill * nbytes)
    for boundaries in (corpus.unit_starts, corpus.paragraph_starts):
        last_inside = bisect.bisect_right(boundaries, limit) - 1
        if last_inside >= 0 and boundaries[last_inside] >= floor:
            return boundaries[last_inside]
    newline = corpus.data.rfind(b"\n", floor, limit)
    if newline >= 0:
        return newline + 1
    return _char_boundary(corpus.data, limit)


def _spread(candidates: list[int], count: int) -> list[int]:
    """`count` candidates spread evenly over the list (all of them when there are fewer)."""
    if len(candidates) <= count:
        return candidates
    step = len(candidates) / count
    return [candidates[int(i * step)] for i in range(count)]


def cut_documents(
    docs_dir: Path, lengths: list[int], per_length: int = 16, min_fill: float = 0.9
) -> dict[int, list[Document]]:
    """For each length N (bytes), up to `per_length` distinct documents of min_fill*N..N bytes."""
    corpus = _load_corpus(docs_dir)
    documents: dict[int, list[Document]] = {}
    for nbytes in lengths:
        if len(corpus.data) < min_fill * nbytes:
            raise DocumentError(
                f"--docs {docs_dir} holds {len(corpus.data)} bytes of text, too little for {nbytes}-byte documents"
            )
        fits = [s for s in corpus.unit_starts if s + min_fill * nbytes <= len(corpus.data)]
        if len(fits) < per_length:
            # too few chapters for distinct documents: start at paragraphs as well
            extra = [s for s in corpus.paragraph_starts if s + min_fill * nbytes <= len(corpus.data)]
            fits = sorted(set(fits) | set(_spread(extra, per_length - len(fits))))
        chosen = _spread(fits, per_length) or [0]
        docs = []
        for start in chosen:
            end = _cut_end(corpus, start, nbytes, min_fill)
            text = corpus.data[start:end].decode("utf-8", errors="replace")
            docs.append(Document(corpus.source_at(start), text))
        documents[nbytes] = docs
    return documents
