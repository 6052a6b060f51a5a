"""Mean-pooled embeddings whitened with the artifact's statistics ((v - mean) @ W), in both backends and on
both embedding routes; an older statistics file without W standardises per dimension; pooling last, the
setting turned off and artifacts without statistics stay raw; a damaged statistics file stops start-up."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from export import load_artifact, save_artifact
from export.artifact import file_sha256
from export.embedding_stats import STATS_FILE, compute_embedding_stats
from model import ByteTokenizer
from model.pooling import EmbeddingStats
from tests.conftest import tiny_model
from tests.service.conftest import REPO
from tests.service.helpers import running_app

TEXTS = ["the cat sat on the mat", "a completely different sentence, longer than the first one"]


@pytest.fixture(scope="module")
def stats_artifact(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny artifact with model.onnx and statistics (whitening included) estimated on a few random passages."""
    model = tiny_model(seed=5)
    rng = np.random.default_rng(0)
    passages = [("random.txt", rng.integers(2, 258, size=48)) for _ in range(6)]
    stats = compute_embedding_stats(model, passages)
    assert stats.whitening is not None
    out = tmp_path_factory.mktemp("stats_artifact") / "artifact"
    save_artifact(model, out, tokenizer=ByteTokenizer(), onnx=True,
                  embedding_stats=(stats, {"passages": 6, "note": "random passages for tests"}))
    return load_artifact(out)


@pytest.fixture(scope="module")
def per_dimension_artifact(stats_artifact: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same model with a statistics file as written before the whitening matrix (mean and std only)."""
    s = stats_artifact.embedding_stats
    out = tmp_path_factory.mktemp("per_dimension_artifact") / "artifact"
    save_artifact(stats_artifact.model, out, tokenizer=ByteTokenizer(), onnx=False,
                  embedding_stats=(EmbeddingStats(mean=s.mean, std=s.std), {"passages": 6, "note": "old format"}))
    return load_artifact(out)


def _raw(artifact: Any, text: str, pooling: str = "mean") -> torch.Tensor:
    ids = torch.tensor([artifact.tokenizer.encode(text)])
    with torch.no_grad():
        return artifact.model.embed(ids, pooling=pooling)[0].float()


def _whitened(artifact: Any, text: str) -> torch.Tensor:
    s = artifact.embedding_stats
    return (_raw(artifact, text) - s.mean) @ s.whitening


def _per_dimension(artifact: Any, text: str) -> torch.Tensor:
    s = artifact.embedding_stats
    return (_raw(artifact, text) - s.mean) / s.std


def _embed(client: Any, **body: Any) -> list[torch.Tensor]:
    r = client.post("/embed", json={"inputs": TEXTS, **body})
    assert r.status_code == 200, r.text
    return [torch.tensor(v) for v in r.json()]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_mean_embeddings_are_whitened_before_normalisation(stats_artifact: Any, backend: str) -> None:
    art = stats_artifact
    with running_app(art, backend=backend, warmup=False) as client:
        info = client.get("/info").json()
        assert info["backend"] == backend
        assert info["embedding_standardization"] == {"standardized": True, "method": "whitening",
                                                     "poolings": ["mean"], "artifact_has_stats": True}
        for text, got in zip(TEXTS, _embed(client, normalize=False), strict=True):
            assert torch.allclose(got, _whitened(art, text), atol=1e-3)
            assert not torch.allclose(got, _raw(art, text), atol=1e-2)
            assert not torch.allclose(got, _per_dimension(art, text), atol=1e-2)
        for text, got in zip(TEXTS, _embed(client, normalize=True), strict=True):
            assert torch.allclose(got, F.normalize(_whitened(art, text), dim=0), atol=1e-4)
        for text, got in zip(TEXTS, _embed(client, normalize=False, pooling="last"), strict=True):
            assert torch.allclose(got, _raw(art, text, "last"), atol=1e-4)  # last stays raw
        r = client.post("/v1/embeddings", json={"input": TEXTS, "model": info["model_id"]})
        assert r.status_code == 200, r.text
        for text, item in zip(TEXTS, r.json()["data"], strict=True):
            assert torch.allclose(torch.tensor(item["embedding"]), F.normalize(_whitened(art, text), dim=0),
                                  atol=1e-4)


def test_an_older_stats_file_without_whitening_standardises_per_dimension(per_dimension_artifact: Any) -> None:
    art = per_dimension_artifact
    assert art.embedding_stats.whitening is None
    with running_app(art, warmup=False) as client:
        assert client.get("/info").json()["embedding_standardization"] == {
            "standardized": True, "method": "per-dimension", "poolings": ["mean"], "artifact_has_stats": True}
        for text, got in zip(TEXTS, _embed(client, normalize=False), strict=True):
            assert torch.allclose(got, _per_dimension(art, text), atol=1e-3)
            assert not torch.allclose(got, _raw(art, text), atol=1e-2)


def test_the_setting_turns_standardisation_off(stats_artifact: Any) -> None:
    art = stats_artifact
    with running_app(art, embed_standardize=False, warmup=False) as client:
        info = client.get("/info").json()
        assert info["embedding_standardization"] == {"standardized": False, "method": None, "poolings": [],
                                                     "artifact_has_stats": True}
        assert info["settings"]["embed_standardize"] is False
        for text, got in zip(TEXTS, _embed(client, normalize=False), strict=True):
            assert torch.allclose(got, _raw(art, text), atol=1e-4)


def test_an_artifact_without_stats_serves_raw_means(artifact: Any) -> None:
    assert artifact.embedding_stats is None
    with running_app(artifact, warmup=False) as client:
        assert client.get("/info").json()["embedding_standardization"]["standardized"] is False
        for text, got in zip(TEXTS, _embed(client, normalize=False), strict=True):
            assert torch.allclose(got, _raw(artifact, text), atol=1e-4)


def test_a_damaged_stats_file_stops_start_up(stats_artifact: Any, tmp_path: Path) -> None:
    broken = tmp_path / "artifact"
    shutil.copytree(stats_artifact.path, broken)
    stats_file = broken / STATS_FILE
    blob = bytearray(stats_file.read_bytes())
    blob[-1] ^= 0x01
    stats_file.write_bytes(bytes(blob))
    assert STATS_FILE in json.loads((broken / "manifest.json").read_text())["files"]
    result = subprocess.run([sys.executable, "-m", "service", str(broken), "--port", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"{STATS_FILE}: altered" in result.stderr


def test_a_malformed_whitening_matrix_stops_start_up_even_when_re_signed(stats_artifact: Any, tmp_path: Path) -> None:
    broken = tmp_path / "artifact"
    shutil.copytree(stats_artifact.path, broken)
    stats_file = broken / STATS_FILE
    tensors = load_file(str(stats_file))
    tensors["whitening"] = tensors["whitening"][:, :-1].contiguous()  # one column short
    save_file(tensors, str(stats_file))
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["files"][STATS_FILE] = {"sha256": file_sha256(stats_file), "size": stats_file.stat().st_size}
    (broken / "manifest.json").write_text(json.dumps(manifest))
    result = subprocess.run([sys.executable, "-m", "service", str(broken), "--port", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"{STATS_FILE}: tensor 'whitening' is torch.float32 (64, 63), expected float32 (64, 64)" in result.stderr
