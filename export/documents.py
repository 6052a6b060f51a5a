"""Text documents as both the trainer and an artifact's embedding statistics read them: UTF-8 files found in
the given sources, cleaned of a Project Gutenberg header and licence, and cut into a training head and a
held-out validation tail (`split_point`). One definition, below both: `reformer train` (train/data.py) puts
the heads in its training windows and the tails in its validation windows, and export/embedding_stats.py
estimates on the heads only, so no validation byte shapes the shipped statistics."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE)
_GUTENBERG_END = re.compile(
    r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)", re.MULTILINE
)


class DataError(ValueError):
    """A problem with the training data that the user must fix (the message names it)."""


def clean_text(text: str) -> str:
    """Drop a byte-order mark, make line ends LF, and keep only the body of a Project Gutenberg book
    (after the `*** START OF ...` line, before `End of (the) Project Gutenberg` / `*** END OF ...`)."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text)
    if start is not None:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end is not None:
        text = text[: end.start()]
    return text.strip("\n") + "\n" if text.strip() else ""


def find_text_files(sources: Sequence[str | Path]) -> list[Path]:
    """Each source is a file or a directory (its *.txt files, sorted, non-recursive)."""
    files: list[Path] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            files.extend(sorted(f for f in p.iterdir() if f.is_file() and f.suffix == ".txt"))
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"training data {str(p)!r} is neither a file nor a directory")
    if not files:
        raise DataError(f"no .txt files found in {[str(s) for s in sources]}: the corpus is empty")
    return files


def read_document(path: Path) -> str:
    try:
        return clean_text(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def split_point(n_tokens: int, val_fraction: float) -> int:
    """Index where a document's validation tail starts (at least one token each side when possible)."""
    n_val = int(round(n_tokens * val_fraction))
    if val_fraction > 0 and n_tokens >= 2:
        n_val = min(max(n_val, 1), n_tokens - 1)
    return n_tokens - n_val
