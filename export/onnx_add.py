"""A verified ONNX graph (and, asked for, its int8 graph) added to an existing artifact in place, made from the
artifact's own model: what `reformer export-onnx` runs. Every other file (weights, tokenizer, statistics) is
kept byte for byte, and every manifest entry but the graphs' (files, export.onnx, export.int8,
evaluation.int8). The graphs are exported, verified and quantised beside the artifact first, so a graph the
check refuses leaves the artifact as it was."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .artifact import (
    MANIFEST_FILE,
    ONNX_FILE,
    ONNX_INT8_FILE,
    code_version,
    file_entry,
    load_artifact,
    manifest_text,
)


def add_onnx_graphs(directory: str | Path, quantize: bool, eval_text: bytes | None, command: str) -> dict[str, Any]:
    """Export, verify (export/onnx_budget.py export_sized: the tie-aware check) and, with `quantize`, quantise
    the artifact's model; move the graphs into `directory` and rewrite its manifest. An int8 graph of an
    earlier export is removed when none is made now (it would no longer match model.onnx). The artifact must
    check out before and does after. Returns the new manifest."""
    from .onnx_budget import export_sized
    from .quantize import quantize_and_evaluate

    directory = Path(directory)
    art = load_artifact(directory)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.onnx.", dir=directory.parent))
    try:
        manifest = dict(art.manifest)
        export = dict(manifest.get("export") or {})
        evaluation = dict(manifest.get("evaluation") or {})
        files = {k: v for k, v in manifest["files"].items() if k not in (ONNX_FILE, ONNX_INT8_FILE)}
        export.pop("int8", None)
        evaluation.pop("int8", None)
        export["onnx"] = export_sized(art.model, staging / ONNX_FILE)
        export["onnx"]["added"] = {"command": command, "code_version": code_version()}
        made = [ONNX_FILE]
        if quantize:
            export["int8"], evaluation["int8"] = quantize_and_evaluate(
                art.model, staging / ONNX_FILE, staging / ONNX_INT8_FILE, art.tokenizer, eval_text)
            made.append(ONNX_INT8_FILE)
        for name in made:
            files[name] = file_entry(staging / name)
        manifest.update(files=dict(sorted(files.items())), export=export, evaluation=evaluation)
        (staging / MANIFEST_FILE).write_text(manifest_text(manifest))
        umask = os.umask(0)
        os.umask(umask)
        for p in staging.iterdir():
            p.chmod(0o644 & ~umask)  # the service may run as another user
        stale = [n for n in (ONNX_FILE, ONNX_INT8_FILE) if n not in made and (directory / n).exists()]
        for name in made:  # graphs first: an interruption leaves files the old manifest refuses, never a mismatch
            os.replace(staging / name, directory / name)
        for name in stale:
            (directory / name).unlink()
        os.replace(staging / MANIFEST_FILE, directory / MANIFEST_FILE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    load_artifact(directory)  # raises ArtifactError if the rewritten artifact does not check out
    return manifest
