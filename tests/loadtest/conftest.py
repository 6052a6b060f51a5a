"""The load test's fixtures: a folder holding one small book."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.loadtest.helpers import write_book


@pytest.fixture()
def docs_dir(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    write_book(docs / "book.txt")
    return docs
