"""/info says which backend runs each stage: embeddings on the configured one, prefill and decoding on torch
(the ONNX graph has no decode step), and both kinds of request are served either way."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from export import load_artifact, save_artifact
from model import ByteTokenizer
from service.api.app import create_app
from service.settings import Settings
from tests.conftest import tiny_model
from tests.service.helpers import running_app, wait_load_error


@pytest.fixture(scope="module")
def onnx_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny artifact with a verified model.onnx (the shipped default has none: docs/MODEL_CARD.md)."""
    out = tmp_path_factory.mktemp("onnx_backend") / "artifact"
    save_artifact(tiny_model(), out, tokenizer=ByteTokenizer(), provenance={"note": "random weights for tests"},
                  onnx=True)
    return out


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_info_reports_the_backend_of_each_stage(backend: str, onnx_artifact: Path) -> None:
    artifact = load_artifact(onnx_artifact)
    assert artifact.onnx_path is not None
    with running_app(artifact, backend=backend, log_level="warning") as client:
        info = client.get("/info").json()
        assert info["backends"] == {"embeddings": backend, "prefill": "torch", "decode": "torch"}
        assert info["backend"] == backend and info["decode_backend"] == "c-fused"
        assert client.post("/embed", json={"inputs": "a few words"}).status_code == 200
        r = client.post("/generate", json={"inputs": "a few words", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200
        engine = client.app.state.service.engine  # type: ignore[attr-defined]
        assert engine.backend.name == backend


def test_onnxruntime_is_refused_at_start_up_for_an_artifact_without_a_graph(tiny_artifact: Path) -> None:
    artifact = load_artifact(tiny_artifact)  # saved with onnx=False, as the shipped default is
    assert artifact.onnx_path is None
    app = create_app(Settings(backend="onnxruntime", log_level="warning"), artifact)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert "has no model.onnx" in wait_load_error(app.state.service)
        assert not app.state.service.ready
        assert client.get("/health").status_code == 503
