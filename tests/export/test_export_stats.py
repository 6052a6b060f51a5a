"""`reformer export-stats`: an existing artifact's embedding statistics recomputed from its own model (no
checkpoint), the file and its manifest entry replaced consistently, everything else kept; the refreshed
artifact loads and verifies, and a tampered whitening matrix in it is refused at load."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from export import ArtifactError, load_artifact, save_artifact
from export.artifact import file_sha256
from export.cli import export_stats_main, verify_main
from export.embedding_stats import SHRINKAGE_GRID, STATS_FILE, compute_embedding_stats, training_passages
from model import ByteTokenizer
from model.pooling import EmbeddingStats
from service.cli import SUBCOMMANDS
from tests.conftest import tiny_model

PASSAGE = 64


def _books(directory: Path) -> Path:
    directory.mkdir()
    for name, letters in (("a.txt", "abc de"), ("b.txt", "xyz uv")):
        (directory / name).write_text("".join(letters[(i * 5) % len(letters)] for i in range(1900)) + "#" * 99)
    return directory


def _manifest(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "manifest.json").read_text())


@pytest.fixture()
def old_artifact(tmp_path: Path) -> Path:
    """An artifact as exported before the whitening matrix: per-dimension mean and std only."""
    out = tmp_path / "art"
    dim = 2 * tiny_model().config.hidden_size
    old = EmbeddingStats(mean=torch.zeros(dim), std=torch.ones(dim))
    save_artifact(tiny_model(seed=3), out, tokenizer=ByteTokenizer(), onnx=False,
                  provenance={"val_fraction": 0.05, "note": "test"},
                  embedding_stats=(old, {"file": STATS_FILE, "what": "per-dimension mean and std", "passages": 60}))
    assert load_artifact(out).embedding_stats.whitening is None  # type: ignore[union-attr]
    return out


def test_refresh_rewrites_the_stats_and_their_manifest_entry_only(old_artifact: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    data = _books(tmp_path / "data")
    before = _manifest(old_artifact)
    argv = [str(old_artifact), "--data", str(data), "--passages", "8", "--passage-bytes", str(PASSAGE)]
    assert export_stats_main(argv) == 0
    printed = capsys.readouterr().out
    assert "training passages" in printed
    after = _manifest(old_artifact)
    assert after["files"][STATS_FILE] == {"sha256": file_sha256(old_artifact / STATS_FILE),
                                          "size": (old_artifact / STATS_FILE).stat().st_size}
    assert after["files"][STATS_FILE] != before["files"][STATS_FILE]
    assert {k: v for k, v in after["files"].items() if k != STATS_FILE} == \
        {k: v for k, v in before["files"].items() if k != STATS_FILE}
    for key in ("provenance", "evaluation", "created", "format_version"):
        assert after[key] == before[key], key
    record = after["export"]["embedding_stats"]
    assert record["passages"] == 8 and record["passage_bytes"] == PASSAGE
    assert record["source_files"] == ["a.txt", "b.txt"]
    shrinkage = record["whitening_shrinkage"]
    assert shrinkage in SHRINKAGE_GRID and "whitening matrix" in record["what"]
    assert f"whitening matrix (shrinkage {shrinkage}) from 8 training passages" in printed
    assert "held-out training-passage accuracy by shrinkage: 0 " in printed
    assert record["refreshed"]["command"].startswith("reformer export-stats ")
    assert not list(old_artifact.glob(".*.tmp"))  # nothing left beside the files
    umask = os.umask(0)
    os.umask(umask)
    assert (old_artifact / STATS_FILE).stat().st_mode & 0o777 == 0o644 & ~umask
    # the same statistics `reformer export` computes from the same model and passages
    art = load_artifact(old_artifact)
    expected = compute_embedding_stats(tiny_model(seed=3), training_passages([data], ByteTokenizer(), 0.05, PASSAGE, 8),
                                       shrinkage)
    got = art.embedding_stats
    assert got is not None and got.whitening is not None and expected.whitening is not None
    assert torch.allclose(got.mean, expected.mean, atol=1e-6) and torch.allclose(got.std, expected.std, atol=1e-6)
    assert torch.allclose(got.whitening.double() @ got.whitening.double().T,
                          expected.whitening.double() @ expected.whitening.double().T, rtol=1e-3, atol=1e-3)
    assert verify_main([str(old_artifact)]) == 0
    assert "mean-pooled embeddings are whitened" in capsys.readouterr().out


def test_a_tampered_whitening_matrix_in_a_refreshed_artifact_is_refused(old_artifact: Path, tmp_path: Path) -> None:
    data = _books(tmp_path / "data")
    assert export_stats_main([str(old_artifact), "--data", str(data), "--passages", "6",
                              "--passage-bytes", str(PASSAGE)]) == 0
    tensors = load_file(str(old_artifact / STATS_FILE))
    tensors["whitening"][0, 0] = float("nan")
    save_file(tensors, str(old_artifact / STATS_FILE))
    with pytest.raises(ArtifactError, match=r"embedding_stats\.safetensors: altered"):
        load_artifact(old_artifact)
    manifest = _manifest(old_artifact)  # re-signed too: the content check still refuses it
    manifest["files"][STATS_FILE] = {"sha256": file_sha256(old_artifact / STATS_FILE),
                                     "size": (old_artifact / STATS_FILE).stat().st_size}
    (old_artifact / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"embedding_stats\.safetensors: tensor 'whitening' has non-finite"):
        load_artifact(old_artifact)
    # and a damaged artifact is not refreshed (that would re-sign whatever else was wrong)
    blob = (old_artifact / "manifest.json").read_bytes()
    assert export_stats_main([str(old_artifact), "--data", str(data), "--passages", "6"]) == 1
    assert (old_artifact / "manifest.json").read_bytes() == blob


def test_refresh_adds_stats_to_an_artifact_without_them(tiny_artifact: Path, tmp_path: Path) -> None:
    art = tmp_path / "copy"
    shutil.copytree(tiny_artifact, art)
    assert load_artifact(art).embedding_stats is None
    assert export_stats_main([str(art), "--data", str(_books(tmp_path / "data")), "--passages", "4",
                              "--passage-bytes", str(PASSAGE)]) == 0
    stats = load_artifact(art).embedding_stats
    assert stats is not None and stats.method == "whitening"
    assert _manifest(art)["export"]["embedding_stats"]["passages"] == 4


def test_refresh_without_usable_data_changes_nothing(old_artifact: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    blob = (old_artifact / "manifest.json").read_bytes(), (old_artifact / STATS_FILE).read_bytes()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_stats_main([str(old_artifact), "--data", str(empty)]) == 1
    assert "no .txt files" in capsys.readouterr().err
    assert export_stats_main([str(old_artifact), "--data", str(_books(tmp_path / "data")), "--passages", "1"]) == 1
    assert "at least 2" in capsys.readouterr().err
    assert ((old_artifact / "manifest.json").read_bytes(), (old_artifact / STATS_FILE).read_bytes()) == blob


def test_export_stats_is_a_reformer_subcommand() -> None:
    module, func, _ = SUBCOMMANDS["export-stats"]
    assert getattr(importlib.import_module(module), func) is export_stats_main
