"""A small Gutenberg-style book for the load test's documents to be cut from, and the real service on a
loopback port for the load test to drive."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
API_KEY = "loadtest-secret"  # the test servers' inference routes need it
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_server(artifact: Path, log_path: Path, **settings: str) -> Iterator[str]:
    """The real service (`python -m service ARTIFACT --port N`, with an API key and `settings` as REFORMER_*
    variables) on a loopback port; yields its URL."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "REFORMER_API_KEY": API_KEY,
           **{f"REFORMER_{name.upper()}": value for name, value in settings.items()}}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", str(artifact), "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"server exited early:\n{log_path.read_text()}"
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"server not ready in 90 s:\n{log_path.read_text()}"
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
