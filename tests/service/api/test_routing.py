"""Routing contract: TGI's `POST /` over real HTTP (raw and with huggingface_hub's client), 405 with its own
error type, /info without filesystem paths, and the import order (routes below the app, never importing it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from huggingface_hub import InferenceClient

from service.api.app import create_app
from service.settings import Settings
from tests.service.conftest import REPO
from tests.service.helpers import running_app, sse_events, wait_ready

pytestmark = pytest.mark.xdist_group("service-routing")


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Any:
    return server_factory(backend="torch", max_new_tokens=16, max_input_tokens=64)


# The body huggingface_hub's InferenceClient(url).text_generation(...) posts to the URL itself (TGI's route).
def hub_body(stream: bool) -> dict[str, Any]:
    return {"inputs": "Once upon", "parameters": {"max_new_tokens": 4, "details": True, "ignore_eos": True,
                                                  "decoder_input_details": False}, "stream": stream}


def test_post_root_without_stream_answers_as_generate_in_a_list(server: Any) -> None:
    r = httpx.post(server.url + "/", json=hub_body(stream=False), timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    (body,) = r.json()  # TGI answers a one-element list here
    assert body["details"]["generated_tokens"] == 4 and isinstance(body["generated_text"], str)
    assert r.headers["x-generated-tokens"] == "4"


def test_post_root_with_stream_answers_as_generate_stream(server: Any) -> None:
    r = httpx.post(server.url + "/", json=hub_body(stream=True), timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert len(events) == 4
    assert all("token" in e for e in events)
    assert events[-1]["details"]["generated_tokens"] == 4
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)


def test_post_root_errors_like_generate(server: Any) -> None:
    r = httpx.post(server.url + "/", json={"inputs": "a", "parameters": {"top_p": 7}}, timeout=30)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_huggingface_hub_inference_client_pointed_at_the_server(server: Any) -> None:
    client = InferenceClient(server.url)
    text = client.text_generation("Once upon", max_new_tokens=4, seed=3)
    assert isinstance(text, str)
    output = client.text_generation("Once upon", max_new_tokens=4, details=True, seed=3)
    assert output.generated_text == text and output.details is not None
    streamed = "".join(client.text_generation("Once upon", max_new_tokens=4, stream=True, seed=3))
    assert streamed == text
    scored = client.text_generation("Once upon", max_new_tokens=4, details=True, decoder_input_details=True,
                                    top_n_tokens=3, seed=3)
    assert scored.generated_text == text and scored.details is not None
    prefill = scored.details.prefill
    assert len(prefill) == len("Once upon") and prefill[0].logprob is None
    assert all(isinstance(t.logprob, float) for t in prefill[1:])
    assert scored.details.top_tokens is not None and len(scored.details.top_tokens) == 4
    assert all(len(top) == 3 for top in scored.details.top_tokens)
    best = client.text_generation("Once upon", max_new_tokens=4, details=True, best_of=2, do_sample=True, seed=3)
    assert best.details is not None and best.details.best_of_sequences is not None
    assert len(best.details.best_of_sequences) == 1


def test_405_has_its_own_error_type_in_both_shapes(artifact: Any) -> None:
    with running_app(artifact) as client:
        native = client.get("/generate")
        assert native.status_code == 405
        assert native.json()["error_type"] == "method_not_allowed", native.json()
        assert "POST" in native.headers["allow"]
        openai = client.get("/v1/completions")
        assert openai.status_code == 405
        assert openai.json()["error"]["code"] == "method_not_allowed", openai.json()


def test_info_names_the_artifact_without_its_path(artifact: Any, tiny_artifact: Path) -> None:
    app = create_app(Settings(artifact=tiny_artifact), artifact)
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(app.state.service)
        r = client.get("/info")
    assert r.status_code == 200
    info = r.json()
    assert info["artifact_name"] == tiny_artifact.name and info["model_sha256"] == artifact.sha256
    assert info["settings"]["artifact"] == tiny_artifact.name
    text = json.dumps(info)
    # No directory of the server's filesystem appears anywhere in the answer.
    for directory in (tiny_artifact, *tiny_artifact.parents[:-1]):
        if len(str(directory)) > 1:
            assert str(directory) not in text, f"/info shows {directory}"


def test_routes_and_state_import_without_the_app() -> None:
    code = ("import sys; import service.api.routes.common, service.api.routes.generate, service.api.routes.meta, "
            "service.api.routes.openai, service.api.routes.embed, service.api.state; "
            "assert 'service.api.app' not in sys.modules, 'a route module imports service.api.app'")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
