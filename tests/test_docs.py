"""The docs a user reads first say what the code has: every setting in the README's table, every README link
and cited result file present, and no lab-notebook wording ("session" is only an HTTP or ONNX Runtime one)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_setting_is_in_the_readme_table() -> None:
    missing = [name for name in Settings.model_fields if f"`REFORMER_{name.upper()}`" not in README]
    assert not missing, f"settings missing from README.md's table: {missing}"


def test_the_readme_links_and_cited_files_exist() -> None:
    paths = re.findall(r"\]\(([^)#]+)\)", README) + re.findall(r"`((?:bench|docs|tests|model)/[^`* ]+)`", README)
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_no_session_numbers_in_the_repository() -> None:
    """Text that says "this session" or "session 9" loses its meaning once written; dates and commits keep it."""
    files = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.sh", "*.c", "*.h", "*.toml", "Makefile",
                            "Dockerfile"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"\b(this|previous|next|earlier|later|that) session\b|\bsession \d|\bsessions? [0-9]",
                         re.IGNORECASE)
    hits = [f"{f}:{n}" for f in files if f != "tests/test_docs.py" and (ROOT / f).exists()
            for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
