"""The import graph of the project's packages: no circles, no module reaching for another's private names, and
every folder importing only the folders below it (`MAY_IMPORT`). Read from the source with `ast`: every
import, inside functions and under `if TYPE_CHECKING:` too (an annotation's import ties two modules as much
as one that runs: neither can be read, moved or tested without the other), so a new circle or a reach up the
layers fails here before it fails at some import order at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "export", "service", "train", "loadtest")

# Each folder and the folders it may import besides its own; a module belongs to the deepest folder named here
# that holds it (model/decoding/steps is model.decoding, model/tokenizers is model). The C kernels' package is
# the bottom; the network is on it; decoding is on the network; export and train are above the model, and train
# may use export but not the reverse; the service is above all but train. The load test is a client of the
# service over HTTP only: it imports none of the project's packages (so it runs without torch).
MODEL_LAYERS = {"model.kernels", "model", "model.decoding"}
MAY_IMPORT: dict[str, set[str]] = {
    "model.kernels": set(),
    "model": {"model.kernels"},
    "model.decoding": {"model", "model.kernels"},
    "export": MODEL_LAYERS,
    "train": MODEL_LAYERS | {"export"},
    "loadtest": set(),
}
# The service's folders, bottom up: the shared base (settings, errors, jobs, memory at service/'s top level);
# text; the prefix cache; observability (which reads the prefix cache's families); the engine; the HTTP side.
# The command line's entry points (`cli`, `__main__`) sit above them all.
BELOW_SERVICE = MODEL_LAYERS | {"export"}
SERVICE_BASE = BELOW_SERVICE | {"service"}
MAY_IMPORT.update({
    "service": BELOW_SERVICE,
    "service.text": SERVICE_BASE,
    "service.prefix_cache": SERVICE_BASE,
    "service.observability": SERVICE_BASE | {"service.prefix_cache"},
    "service.engine": SERVICE_BASE | {"service.text", "service.prefix_cache", "service.observability"},
    "service.api": SERVICE_BASE | {"service.text", "service.prefix_cache", "service.observability",
                                   "service.engine"},
})
MAY_IMPORT["service.cli"] = MAY_IMPORT["service.__main__"] = SERVICE_BASE | set(MAY_IMPORT["service.api"]) | {
    "service.api"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import in the file, whether it runs or not."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []

    def visit(node: ast.AST) -> None:
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


def _layer(module: str) -> str:
    holders = [folder for folder in MAY_IMPORT if module == folder or module.startswith(folder + ".")]
    assert holders, f"{module} is in no folder of MAY_IMPORT: give its folder a place in the layers"
    return max(holders, key=len)


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a folder its own folder may not import."""
    return [f"{module} ({_layer(module)}) imports {dep} ({_layer(dep)})"
            for module, deps in sorted(graph.items()) for dep in sorted(deps)
            if _layer(dep) != _layer(module) and _layer(dep) not in MAY_IMPORT[_layer(module)]]


def test_every_folder_imports_only_the_folders_below_it() -> None:
    graph = _graph()
    assert {_layer(m) for m in graph} == set(MAY_IMPORT)  # every layer is found, so the check reads them all
    violations = _layer_violations(graph)
    assert not violations, "imports against the layers:\n" + "\n".join(violations)


@pytest.mark.parametrize(("low", "high"), [
    ("model.kernels.abi", "model.config"),
    ("model.attention", "model.decoding.cache"),
    ("model.decoding.cache", "export.artifact"),
    ("export.embedding_stats", "train.data"),
    ("export.artifact", "service.engine.core"),
])
def test_the_check_allows_an_import_down_and_refuses_one_up(low: str, high: str) -> None:
    assert _layer_violations({high: {low}, low: set()}) == []
    assert _layer_violations({low: {high}, high: set()}) == [f"{low} ({_layer(low)}) imports {high} ({_layer(high)})"]


def test_the_check_refuses_train_and_the_service_each_other() -> None:
    assert len(_layer_violations({"service.engine.core": {"train.data"}, "train.loop": {"service.engine.core"}})) == 2


def test_an_import_under_type_checking_counts(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from service.engine.core import Engine\n")
    assert ("service.engine.core", ["Engine"]) in _imports(source, "model.mod", _modules())


@pytest.mark.parametrize("layer", ["model.decoding.plan", "model.kernels.abi"])
def test_leaf_modules_stay_leaves(layer: str) -> None:
    """The layer plan and the C interface are read by every step backend: they import no decoding module."""
    deps = _graph()[layer]
    assert not {d for d in deps if d.startswith(("model.decoding", "service", "export"))}, deps
