"""Result files as data: a benchmark that keeps per-trial records writes them gzip-compressed (`NAME.json.gz`),
so that a run adds kilobytes to bench/results, not megabytes; small summaries stay plain `.json`.

`write_json` compresses when the path ends in `.gz` (with a fixed mtime of 0, so the same result gives the same
bytes); `read_json` reads either form. `zcat FILE.json.gz | python -m json.tool` shows one by hand."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any, indent: int | None = 2) -> None:
    text = json.dumps(data, indent=indent) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def read_json(path: Path) -> Any:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)
