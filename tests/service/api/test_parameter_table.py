"""The parameter table (service/api/protocol/parameters.py) covers every field of every request body the app
publishes, names only fields that exist and tests that exist, and is what docs/API.md shows: a new field
cannot reach a route without a row saying whether it is honoured or refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.api.app import create_app
from service.api.protocol.common import RequestModel
from service.api.protocol.parameters import PARAMETERS, render_markdown
from service.settings import Settings

REPO = Path(__file__).resolve().parents[3]
OPENAPI: dict[str, Any] = create_app(Settings()).openapi()  # type: ignore[call-arg]


def _request_models() -> dict[str, type[RequestModel]]:
    found: dict[str, type[RequestModel]] = {}
    pending = list(RequestModel.__subclasses__())
    while pending:
        model = pending.pop()
        found[model.__name__] = model
        pending.extend(model.__subclasses__())
    return found


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        here = {str(node["$ref"]).rsplit("/", 1)[-1]} if "$ref" in node else set()
        return here.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def body_models() -> set[str]:
    """Every schema a route's request body reaches, nested ones included (OpenAPI component names, which are
    the models' class names; a `-Input` suffix marks a model used both ways)."""
    schemas = OPENAPI["components"]["schemas"]
    names = {ref for path in OPENAPI["paths"].values() for op in path.values()
             for ref in _refs(op.get("requestBody", {}))}
    todo = list(names)
    while todo:
        for ref in _refs(schemas[todo.pop()]) - names:
            names.add(ref)
            todo.append(ref)
    return {name.removesuffix("-Input") for name in names}


def test_every_field_of_every_request_body_has_a_row() -> None:
    models = _request_models()
    bodies = body_models()
    assert {"GenerateRequest", "GenerateParameters", "CompletionRequest", "EmbedRequest"} <= bodies
    missing = []
    for name in sorted(bodies):
        assert name in models, f"{name} is a request body but not a RequestModel (undeclared fields pass)"
        rows = PARAMETERS.get(name, {})
        missing += [f"{name}.{field}" for field in models[name].model_fields if field not in rows]
    assert not missing, f"fields with no row in service/api/protocol/parameters.py: {missing}"


def test_every_row_names_a_field_and_tests_that_exist() -> None:
    models = _request_models()
    for name, rows in PARAMETERS.items():
        assert name in models, name
        assert set(rows) <= set(models[name].model_fields), (name, set(rows) - set(models[name].model_fields))
        for field, row in rows.items():
            assert row.shown_by, (name, field)
            for test in row.shown_by:
                path, _, function = test.partition("::")
                source = (REPO / "tests" / path).read_text()
                assert f"def {function}(" in source, (name, field, test)


def test_refused_fields_are_refused_by_a_validator_that_names_them() -> None:
    models = _request_models()
    for name, rows in PARAMETERS.items():
        for field, row in rows.items():
            if row.status == "refused":
                assert models[name].model_fields[field].default in (None, False), (name, field)


def test_docs_api_shows_the_table() -> None:
    assert render_markdown() in (REPO / "docs" / "API.md").read_text()
