"""The import graph of the project's packages: no circles, no module reaching for another's private names, and
the C kernels' package importing nothing from the model. Read from the source with `ast` (every import, inside
functions too, except those under `if TYPE_CHECKING:`, which never run), so a new circle fails here before it
fails at some import order at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "export", "service", "train")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import that runs."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            plain = [n for n in names if f"{target}.{n}" not in modules]  # a submodule is a module import
            found.extend((f"{target}.{n}", []) for n in names if f"{target}.{n}" in modules)
            found.append((target, plain))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return [(m, names) for m, names in found if m.split(".")[0] in PACKAGES]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m for m, _ in _imports(path, name, modules) if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ importing its own submodules (to re-export them) is not a circle of the code: drop
    the edges from a package to modules inside it."""
    return {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}


def test_there_are_no_import_circles() -> None:
    cycles = _cycles(_without_package_inits(_graph()))
    assert not cycles, f"import circles: {cycles}"


def test_the_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_names() -> None:
    modules = _modules()
    bad = [f"{name} takes {n} from {target}" for name, path in modules.items()
           for target, names in _imports(path, name, modules) for n in names
           if n.startswith("_") and not n.startswith("__") and target != name]
    assert not bad, bad


def test_the_kernels_package_imports_nothing_from_the_model() -> None:
    graph = _graph()
    outside = {m: sorted(d for d in deps if not d.startswith("model.kernels"))
               for m, deps in graph.items() if m.startswith("model.kernels")}
    assert graph.get("model.kernels.bindings") is not None
    assert not any(outside.values()), outside


@pytest.mark.parametrize("layer", ["model.decoding.plan", "model.kernels.abi"])
def test_leaf_modules_stay_leaves(layer: str) -> None:
    """The layer plan and the C interface are read by every step backend: they import no decoding module."""
    deps = _graph()[layer]
    assert not {d for d in deps if d.startswith(("model.decoding", "service", "export"))}, deps
