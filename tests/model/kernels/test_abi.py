"""model/kernels/abi.py against the C sources it describes: the row-fact columns, the fused step's structs and
every exported function's prototype, read from csrc/ with regular expressions, so an edit on one side that the
other does not make fails here (before, only the structs' word counts were compared, at load)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from model.kernels import abi, build

CSRC = Path(build.__file__).parent / "csrc"


def _header() -> str:
    return (CSRC / "step_kernels.h").read_text()


def _sources() -> str:
    return "\n".join(p.read_text() for p in sorted(CSRC.glob("*.c")))


def _struct_fields(text: str, name: str) -> list[tuple[str, bool]]:
    """(field, is_pointer) of `typedef struct { ... } name;` in declaration order."""
    body = re.search(r"typedef struct \{([^{}]*)\}\s*" + name + r";", text)
    assert body is not None, f"no struct {name} in step_kernels.h"
    fields: list[tuple[str, bool]] = []
    for decl in re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S).split(";"):
        decl = decl.strip()
        if not decl:
            continue
        base, _, rest = decl.partition(" ")
        if base == "const":
            base, _, rest = rest.partition(" ")
        for item in rest.split(","):
            fields.append((item.strip().lstrip("*").strip(), "*" in item))
    return fields


def _prototype(text: str, name: str) -> tuple[str, str]:
    """The return type and parameter letters (I int64_t, F float, P pointer) of a function definition."""
    m = re.search(r"^(int64_t|int|void)\s+" + name + r"\s*\(([^)]*)\)\s*\{", text, re.M)
    assert m is not None, f"no definition of {name} in csrc/"
    params = m.group(2).strip()
    letters = ""
    for p in ([] if params in ("", "void") else params.split(",")):
        p = p.strip()
        letters += "P" if "*" in p else "I" if p.startswith("int64_t") else "F" if p.startswith("float") else "?"
    return m.group(1), letters


def test_the_row_fact_columns_are_the_headers() -> None:
    defines = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define META_(\w+)\s+(\d+)", _header())}
    assert defines.pop("COLUMNS") == abi.META_COLUMNS
    assert defines == {m.name: int(m) for m in abi.Meta}


@pytest.mark.parametrize("struct", [abi.StepLayer, abi.StepEmbedding], ids=lambda s: s.__name__)
def test_the_step_structs_are_the_headers(struct: type[ctypes.Structure]) -> None:
    want = [(name, kind is ctypes.c_void_p) for name, kind in struct._fields_]
    assert _struct_fields(_header(), struct.__name__) == want
    assert all(ctypes.sizeof(kind) == 8 for _, kind in struct._fields_)


@pytest.mark.parametrize("name", sorted(abi.PROTOTYPES))
def test_each_prototype_is_the_c_definitions(name: str) -> None:
    assert _prototype(_sources(), name) == abi.PROTOTYPES[name]


def test_the_status_codes_are_the_headers() -> None:
    codes = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define (NO_MEMORY|BAD_INDEX|BAD_KIND) (\d+)",
                                                               _header())}
    assert codes == {"NO_MEMORY": abi.NO_MEMORY, "BAD_INDEX": abi.BAD_INDEX, "BAD_KIND": abi.BAD_KIND}


def test_no_c_source_reads_a_row_fact_by_number() -> None:
    """Every read of meta goes through a META_ name (a number would silently read another column)."""
    numbered = re.findall(r"meta\s*\+?\s*\[?\s*b\s*\*\s*\d", _sources())
    assert not numbered, numbered


def test_a_changed_struct_is_caught() -> None:
    """The parser sees a field the Python side does not have."""
    text = _header().replace("int64_t ff, act;", "int64_t ff, act, extra;")
    assert _struct_fields(text, "StepLayer") != [(n, k is ctypes.c_void_p) for n, k in abi.StepLayer._fields_]


def test_the_loaded_library_agrees(kernel: object) -> None:
    assert kernel.layer_words * 8 == ctypes.sizeof(abi.StepLayer)  # type: ignore[attr-defined]
    assert kernel.embedding_words * 8 == ctypes.sizeof(abi.StepEmbedding)  # type: ignore[attr-defined]


def test_one_key_norm_epsilon_on_both_sides() -> None:
    from model.attention import KEY_NORM_EPS

    m = re.search(r"#define KEY_NORM_EPS ([0-9.e-]+)f", _header())
    assert m is not None and float(m.group(1)) == abi.KEY_NORM_EPS == KEY_NORM_EPS
    assert "1e-6" not in re.sub(r"#define KEY_NORM_EPS[^\n]*", "", _sources())
