"""loadtest/documents.py: documents cut from books at chapter starts, without Gutenberg boilerplate, following
links, and the errors for folders with too little text."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.documents import DocumentError, cut_documents
from tests.loadtest.helpers import write_book


def test_documents_start_at_chapters_fit_the_length_and_drop_gutenberg_boilerplate(docs_dir: Path) -> None:
    lengths = [256, 1024]
    documents = cut_documents(docs_dir, lengths, per_length=4)
    for length in lengths:
        docs = documents[length]
        assert len(docs) == 4 and len({d.text for d in docs}) == 4
        for doc in docs:
            assert 0.9 * length <= doc.nbytes <= length
            assert doc.text.startswith("CHAPTER ")
            assert "\r" not in doc.text and "GUTENBERG" not in doc.text and "LICENCE" not in doc.text
            assert doc.text.encode("utf-8").decode("utf-8") == doc.text  # no split character


def test_symlinked_books_and_directories_are_followed(tmp_path: Path) -> None:
    library = tmp_path / "library"
    (library / "shelf").mkdir(parents=True)
    write_book(library / "linked.txt", chapters=4, paragraphs=3)
    write_book(library / "shelf" / "in_linked_dir.txt", chapters=4, paragraphs=3)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "book.txt").symlink_to(library / "linked.txt")  # a directory of links to books elsewhere
    (docs / "shelf").symlink_to(library / "shelf", target_is_directory=True)
    (docs / "shelf_again").symlink_to(library / "shelf", target_is_directory=True)  # same files: read once
    (library / "shelf" / "loop").symlink_to(docs, target_is_directory=True)  # a cycle must not hang
    sources = {d.source for d in cut_documents(docs, [256], per_length=8)[256]}
    assert sources == {"book.txt", "shelf/in_linked_dir.txt"}


def test_only_links_is_still_enough_and_no_text_is_named(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.md").write_text("not a book")
    with pytest.raises(DocumentError, match="no text files"):
        cut_documents(docs, [256])
    write_book(tmp_path / "elsewhere.txt", chapters=2, paragraphs=2)
    (docs / "book.txt").symlink_to(tmp_path / "elsewhere.txt")
    with pytest.raises(DocumentError, match="too little"):
        cut_documents(docs, [65536])
    assert cut_documents(docs, [256])[256]
