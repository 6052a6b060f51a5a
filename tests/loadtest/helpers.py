"""A small Gutenberg-style book for the load test's documents to be cut from."""

from __future__ import annotations

from pathlib import Path

HEADER = "The Project Gutenberg EBook of A Test Book\n\n*** START OF THIS PROJECT GUTENBERG EBOOK TEST ***\n"
FOOTER = "\n*** END OF THIS PROJECT GUTENBERG EBOOK TEST ***\nLICENCE TEXT that must never be sent\n"


def write_book(path: Path, chapters: int = 12, paragraphs: int = 6) -> None:
    """A small Gutenberg-style book: header, CRLF line ends, chapters of multi-byte prose, licence footer."""
    body = []
    for c in range(1, chapters + 1):
        body.append(f"CHAPTER {c}\r\n\r\n")
        for p in range(paragraphs):
            body.append(f"Paragraph {p} of chapter {c}: Rostóv said “naïve café” — déjà vu, {c * p}.\r\n\r\n")
    path.write_text(HEADER + "".join(body) + FOOTER, encoding="utf-8")
