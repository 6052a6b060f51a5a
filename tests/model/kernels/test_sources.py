"""One list of the C kernels' sources and flags (model/kernels/sources.py): setup.py's extensions and build.py's
first-use build read the same files and flags, and the list holds every file of csrc/."""

from __future__ import annotations

import ast
import platform
import runpy
from pathlib import Path
from typing import Any

import pytest
import setuptools

from model.kernels import build, sources

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "model" / "kernels" / "csrc"


def _setup_extensions(monkeypatch: pytest.MonkeyPatch) -> list[setuptools.Extension]:
    """The extensions setup.py hands to setuptools, run as pip runs it but with `setup` recording its arguments."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    return list(seen["ext_modules"])


def test_setup_builds_every_variant_from_the_listed_sources_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    extensions = _setup_extensions(monkeypatch)
    names = [e.name.rsplit("_", 1)[1] for e in extensions]
    assert names == sources.variants_for(platform.machine())
    for ext, name in zip(extensions, names, strict=True):
        assert [ROOT / s for s in ext.sources] == list(build.SOURCES)
        assert [ROOT / h for h in ext.depends] == list(build.HEADERS)
        assert ext.extra_compile_args == [*build.COMMON_FLAGS, build.OPENMP, *build.VARIANTS[name][0]]
        assert ext.extra_link_args == [build.OPENMP, *build.LINK_FLAGS]


def test_the_first_use_build_compiles_the_same_list(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """compile_library's command line, recorded instead of run: the listed sources, flags and link flags."""
    commands: list[list[str]] = []
    monkeypatch.setattr(build.subprocess, "run", lambda cmd, **kwargs: commands.append(cmd))
    monkeypatch.setattr(build.os, "replace", lambda src, dst: None)
    build.compile_library("cc", tmp_path / "lib.so", ("-march=native",))
    [command] = commands
    assert command[1:] == [*build.COMMON_FLAGS, "-march=native", "-shared", build.OPENMP,
                           *map(str, build.SOURCES), "-o", command[-len(build.LINK_FLAGS) - 1],
                           *build.LINK_FLAGS]


def test_the_list_holds_every_file_of_csrc() -> None:
    assert sorted(sources.SOURCES) == sorted(p.name for p in CSRC.glob("*.c"))
    assert sorted(sources.HEADERS) == sorted(p.name for p in CSRC.glob("*.h"))


def test_sources_py_imports_nothing() -> None:
    """setup.py loads it by path before the package's dependencies are installed."""
    tree = ast.parse((ROOT / "model" / "kernels" / "sources.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
