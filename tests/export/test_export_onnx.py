"""`reformer export-onnx`: a verified graph and its int8 graph added to an existing artifact from its own model,
every other file kept byte for byte; a graph the check refuses leaves the artifact as it was."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from export import load_artifact, save_artifact
from export import onnx_budget as ob
from export import onnx_export as ox
from export.artifact import file_sha256
from export.cli import export_onnx_main
from model import ByteTokenizer
from service.cli import SUBCOMMANDS
from tests.conftest import tiny_model


def _manifest(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "manifest.json").read_text())


@pytest.fixture()
def bare_artifact(tmp_path: Path) -> Path:
    out = tmp_path / "art"
    save_artifact(tiny_model(seed=3), out, tokenizer=ByteTokenizer(), onnx=False, provenance={"note": "test"})
    return out


def test_graphs_are_added_and_everything_else_kept(bare_artifact: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = _manifest(bare_artifact)
    hashes = {p.name: file_sha256(p) for p in bare_artifact.iterdir()}
    assert export_onnx_main([str(bare_artifact), "--quantize", "int8"]) == 0
    assert "ONNX (opset" in capsys.readouterr().out
    after = _manifest(bare_artifact)
    for name, digest in hashes.items():
        if name != "manifest.json":
            assert file_sha256(bare_artifact / name) == digest == after["files"][name]["sha256"]
    assert set(after["files"]) == set(before["files"]) | {"model.onnx", "model.int8.onnx"}
    assert {k: after[k] for k in ("provenance", "created")} == {k: before[k] for k in ("provenance", "created")}
    onnx = after["export"]["onnx"]
    assert onnx["added"]["command"] == f"reformer export-onnx {bare_artifact} --quantize int8"
    assert onnx["parity"]["hashing_cases"] and onnx["parity"]["tie_margin"] == 1e-5
    assert "bits_per_byte_int8" in after["evaluation"]["int8"]
    art = load_artifact(bare_artifact)
    assert art.onnx_path is not None and art.onnx_int8_path is not None
    # again without --quantize: the int8 graph of the earlier graph goes with its records (the export itself is
    # not what this checks: the first run's graph stands in for it)
    shutil.copy(bare_artifact / "model.onnx", tmp_path / "graph.onnx")

    def same_graph(model: object, path: Path) -> dict[str, Any]:
        shutil.copy(tmp_path / "graph.onnx", path)
        return dict(onnx)

    monkeypatch.setattr(ob, "export_sized", same_graph)
    assert export_onnx_main([str(bare_artifact)]) == 0
    again = _manifest(bare_artifact)
    assert "model.int8.onnx" not in again["files"] and not (bare_artifact / "model.int8.onnx").exists()
    assert "int8" not in again["evaluation"] and "int8" not in again["export"]
    assert load_artifact(bare_artifact).onnx_int8_path is None


def test_a_refused_graph_leaves_the_artifact_as_it_was(bare_artifact: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    listing = {p.name: file_sha256(p) for p in bare_artifact.iterdir()}

    def refuse(*args: object, **kwargs: object) -> dict[str, Any]:
        raise ox.ExportError("model.onnx: refused for the test")

    monkeypatch.setattr(ox, "verify_onnx", refuse)
    assert export_onnx_main([str(bare_artifact)]) == 1
    assert "refused for the test" in capsys.readouterr().err
    assert {p.name: file_sha256(p) for p in bare_artifact.iterdir()} == listing
    assert [p.name for p in bare_artifact.parent.iterdir()] == ["art"]  # no staging directory left


def test_the_command_is_registered() -> None:
    module, func, _ = SUBCOMMANDS["export-onnx"]
    assert getattr(importlib.import_module(module), func) is export_onnx_main
