"""Which text files `reformer train` reads: paths given on the command line, and/or the corpus's two named
sets (the folders `reformer data` writes, train/corpus_fetch.py), optionally narrowed to some files by name.

    reformer train --out runs/x ...                          both named sets (corpus/data, corpus/corpus)
    reformer train corpus/data --out runs/x ...              the paths only
    reformer train --corpus data,corpus --files 'war*,emma*' two files of the two sets

Where a folder's README.md lists sha256 digests (in full, or the first 16 hex digits of a table column; `reformer
data` writes one per set), each file read from that folder must match its listed digest, so a run never trains
on a silently changed book. Every file's full digest is
recorded in the checkpoint's provenance (train/data.py Corpus.provenance) and so in the exported artifact."""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

from .corpus_manifest import SETS, set_folder
from .data import DataError, find_text_files

NAMED_SETS: dict[str, Path] = {name: set_folder(name) for name in SETS}
DEFAULT_SETS = SETS
_HEX = re.compile(r"\b[0-9a-f]{16,64}\b")


def add_corpus_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training text (train/corpus.py)")
    g.add_argument("--corpus", type=parse_sets,
                   help="named sets to read, comma-separated: data (corpus/data, 3 books), corpus (corpus/corpus, "
                        "18 novels), as `reformer data` writes them; default: both when no DATA path is given, "
                        "none otherwise")
    g.add_argument("--files", type=_patterns, default=(),
                   help="keep only files whose name matches one of these comma-separated shell patterns")
    g.add_argument("--exclude-files", type=_patterns, default=(),
                   help="drop files whose name matches one of these comma-separated shell patterns")


def _patterns(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def parse_sets(text: str) -> tuple[str, ...]:
    names = _patterns(text)
    unknown = [n for n in names if n not in NAMED_SETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown corpus name(s) {unknown or [text]}: use {', '.join(NAMED_SETS)}")
    return names


def resolve_sources(paths: Sequence[str | Path], sets: Sequence[str] | None) -> list[Path]:
    """The files and folders to read: the paths as given, plus the named folders; with neither, both
    named sets (the wider corpus is the default for a bare `reformer train --out ...`)."""
    chosen = list(sets) if sets is not None else ([] if paths else list(DEFAULT_SETS))
    out = [Path(p) for p in paths]
    for name in chosen:
        folder = NAMED_SETS[name]
        if not folder.is_dir():
            raise DataError(f"--corpus {name}: {folder} is not a directory (run `reformer data` to write it)")
        out.append(folder)
    if not out:
        raise DataError("no training text: give DATA paths or --corpus")
    return out


def select_files(sources: Sequence[str | Path], include: Sequence[str] = (), exclude: Sequence[str] = ()
                 ) -> list[Path]:
    """The .txt files of `sources` (train/data.py find_text_files), narrowed by name patterns; a pattern
    that matches nothing is an error, since a typo would otherwise train on less text without a word."""
    files = find_text_files(sources)
    for pat in (*include, *exclude):
        if not any(fnmatch.fnmatch(f.name, pat) for f in files):
            raise DataError(f"file pattern {pat!r} matches none of {len(files)} files")
    if include:
        files = [f for f in files if any(fnmatch.fnmatch(f.name, p) for p in include)]
    files = [f for f in files if not any(fnmatch.fnmatch(f.name, p) for p in exclude)]
    names = [f.name for f in files]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        # the token cache and the provenance key documents by file name
        raise DataError(f"two training files share a name: {', '.join(dup)}")
    if not files:
        raise DataError("every training file was excluded by --files / --exclude-files")
    return files


def listed_digests(readme: Path) -> dict[str, str]:
    """file name -> the sha256 (or its first hex digits) a folder's README.md lists for it: from table rows
    (`| name | bytes | digest |`) and `sha256sum` lines (`digest  name`)."""
    out: dict[str, str] = {}
    if not readme.is_file():
        return out
    for line in readme.read_text(encoding="utf-8").splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].endswith(".txt"):
            digest = next((c for c in cells[1:] if _HEX.fullmatch(c)), None)
            if digest:
                out[cells[0]] = digest
            continue
        parts = line.split()
        if len(parts) == 2 and _HEX.fullmatch(parts[0]) and parts[1].endswith(".txt"):
            out[parts[1]] = parts[0]
    return out


def check_listed_digests(files: Sequence[Path]) -> None:
    """Each file whose folder's README lists a digest for it must match it (prefix match for short ones)."""
    by_folder: dict[Path, dict[str, str]] = {}
    for f in files:
        listed = by_folder.setdefault(f.parent, listed_digests(f.parent / "README.md"))
        want = listed.get(f.name)
        if want is None:
            continue
        got = hashlib.sha256(f.read_bytes()).hexdigest()
        if not got.startswith(want):
            raise DataError(f"{f}: sha256 {got[:16]}... differs from {want[:16]}... listed in {f.parent}/README.md")
