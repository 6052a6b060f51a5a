"""The result files the docs cite exist, and the figures written beside a cited JSON file come from it.

Every `bench/results/...` path in a doc (a tracked .md file; a script's default output need not exist yet)
resolves, a placeholder (NAME, ARM, N, B, FILE, `<minutes>`, `{2,4,8}`, `*`) matching at least one file; every
result file a doc names bare (`val_bpb_run9.json`) is in bench/results/. And in a table row that cites JSON result
files, each figure written with three or four decimals is one of their numbers at the precision written (or its
negative, or its percentage), or the difference of two such figures written in the row ("-0.0549 (1.9473
against 2.0022)"); bounds quoted as "than X" aside. A figure typed into a doc stays traceable to its file.
And no text result over 40 KB is checked in uncompressed."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
RESULT_PATH = re.compile(r"bench/results/([\w.{},*/<>-]+[\w}*/])")
# a result file named bare; `_2.json`, a suffix of the name before it, is not one
BARE = re.compile(r"`([A-Za-z][\w{},*-]*\.(?:json|jsonl|csv|png)(?:\.gz)?)`")
PLACEHOLDER = {"NAME": "*", "ARM": "*", "N": "*", "B": "*", "FILE": "*"}
DOC_GLOBS = ("*.md", "*.py", "*.sh", "Makefile")
NOT_RESULTS = {"config.json", "manifest.json", "tokenizer.json", "reformer_tokenizer.json", "curve.csv", "log.jsonl",
               "info.json", "train_log.jsonl", "gpu_check.json"}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", *DOC_GLOBS], cwd=ROOT, capture_output=True, text=True, check=True)
    return [f for f in out.stdout.split() if not f.startswith("bench/results/") and (ROOT / f).is_file()]


def _matches(name: str) -> bool:
    pattern = name.rstrip(".,;:)/")
    for word, glob in PLACEHOLDER.items():
        pattern = re.sub(rf"(?<![A-Za-z]){re.escape(word)}(?![A-Za-z])", glob, pattern)
    pattern = re.sub(r"\{[^}]*\}", "*", pattern)
    pattern = re.sub(r"<[^>]*>", "*", pattern)
    if "*" in pattern:
        return any(RESULTS.glob(pattern))
    return (RESULTS / pattern).exists()


def test_every_cited_result_path_resolves() -> None:
    missing = []
    for f in [f for f in _tracked() if f.endswith(".md")]:
        for n, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            missing += [f"{f}:{n}: bench/results/{p}" for p in RESULT_PATH.findall(line) if not _matches(p)]
    assert not missing, missing


def test_every_result_file_a_doc_names_bare_exists() -> None:
    docs = [f for f in _tracked() if f.endswith(".md")]
    missing = []
    for f in docs:
        for n, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            for name in BARE.findall(line):
                if name not in NOT_RESULTS and not _matches(name):
                    missing.append(f"{f}:{n}: {name}")
    assert not missing, missing


def _numbers(value: object) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, str):  # tables the scripts render into their results
        yield from (float(x) for x in re.findall(r"-?\d+\.\d+", value))


@cache
def _file_numbers(name: str) -> frozenset[str]:
    data = (RESULTS / name).read_bytes()
    numbers = list(_numbers(json.loads(gzip.decompress(data) if name.endswith(".gz") else data)))
    shown = set()
    for x in numbers:
        for v in (x, -x, 100 * x):
            for places in (3, 4):
                shown.add(f"{v:.{places}f}")
    return frozenset(shown)


FIGURE = re.compile(r"(?<![\w.])[-+]?\d+\.\d{3,4}(?![\d.])")


def _figure_rows() -> Iterator[tuple[str, int, list[str], str]]:
    """(doc, line number, cited files, row) for each table row citing JSON result files."""
    for f in _tracked():
        if not f.endswith(".md"):
            continue
        for n, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            if not line.startswith("|"):
                continue
            names = sorted({m for m in re.findall(r"([\w-]+\.json(?:\.gz)?)", line) if (RESULTS / m).is_file()})
            if names:
                yield f, n, names, line


def test_figures_beside_a_cited_result_file_are_among_its_numbers() -> None:
    checked, wrong = 0, []
    for f, n, names, row in _figure_rows():
        text = re.sub(r"`[^`]*`", "", row)  # commands and file names are not figures
        text = re.sub(r"\bthan \d+\.\d+(?: / \d+\.\d+)?", "", text)  # "no worse than X": a bound, from elsewhere
        numbers = frozenset().union(*(_file_numbers(name) for name in names))
        figures = FIGURE.findall(text)
        found = [x for x in figures if x.lstrip("+") in numbers]
        places = {len(x.partition(".")[2]) for x in figures}
        differences = {f"{float(a) - float(b):+.{p}f}" for a in found for b in found for p in places}
        for figure in figures:
            checked += 1
            signed = f"{float(figure):+.{len(figure.partition('.')[2])}f}"
            if figure.lstrip("+") not in numbers and signed not in differences:
                wrong.append(f"{f}:{n}: {figure} not in {', '.join(names)}")
    assert checked > 40, checked
    assert not wrong, wrong


def test_no_result_file_is_a_large_uncompressed_log() -> None:
    """A run adds kilobytes: text results over 40 KB (per-trial records) are kept gzip-compressed, as the
    benchmarks that write them do (bench/results_io.py); PNG plots are compressed already."""
    out = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True, check=True)
    large = [f for f in out.stdout.split() if (ROOT / f).is_file() and (ROOT / f).stat().st_size > 40_000
             and not f.endswith((".gz", ".png"))]
    assert not large, large
