"""/info says which backend runs each stage: embeddings on the configured one, prefill and decoding on torch
(the ONNX graph has no decode step), and both kinds of request are served either way."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from export import load_artifact
from service.api.app import create_app
from service.settings import Settings
from tests.service.helpers import running_app, wait_load_error


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_info_reports_the_backend_of_each_stage(backend: str) -> None:
    artifact = load_artifact()  # the shipped default artifact carries model.onnx
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
    artifact = load_artifact(tiny_artifact)  # saved with onnx=False
    assert artifact.onnx_path is None
    app = create_app(Settings(backend="onnxruntime", log_level="warning"), artifact)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert "has no model.onnx" in wait_load_error(app.state.service)
        assert not app.state.service.ready
        assert client.get("/health").status_code == 503
