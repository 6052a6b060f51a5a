"""Result files as data: `write_json` gzips a `.gz` name with fixed bytes and writes others as plain JSON;
`read_json` reads both."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from bench.results_io import read_json, write_json


def test_a_gz_name_is_compressed_and_reads_back(tmp_path: Path) -> None:
    data = {"rows": [{"length": 1024, "passkey_correct": 20}], "records": list(range(500))}
    gz, plain = tmp_path / "r.json.gz", tmp_path / "sub" / "r.json"
    write_json(gz, data)
    write_json(plain, data)
    assert json.loads(gzip.decompress(gz.read_bytes())) == data == json.loads(plain.read_text())
    assert read_json(gz) == data == read_json(plain)
    assert gz.stat().st_size < plain.stat().st_size
    first = gz.read_bytes()
    write_json(gz, data)
    assert gz.read_bytes() == first  # no timestamp in the header: the same result gives the same bytes
