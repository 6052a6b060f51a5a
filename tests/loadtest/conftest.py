"""The load test's fixtures: a folder holding one small book, and a real server to drive."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.loadtest.helpers import running_server, write_book


@pytest.fixture()
def docs_dir(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    write_book(docs / "book.txt")
    return docs


@pytest.fixture(scope="module")
def server_url(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real service on a tiny random artifact, default settings (prefix cache on), one per test module."""
    with running_server(tiny_artifact, tmp_path_factory.mktemp("server") / "server.log") as url:
        yield url
