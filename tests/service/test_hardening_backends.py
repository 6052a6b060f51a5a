"""/info says which backend runs each stage: embeddings on the configured one, prefill and decoding on torch
(the ONNX graph has no decode step), and both kinds of request are served either way."""

from __future__ import annotations

import pytest

from export import load_artifact
from tests.service.helpers import running_app


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
