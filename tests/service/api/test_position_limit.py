"""A prompt and its generation must fit in the model's positions (max_position_embeddings) together. As TGI:
an explicit max_new_tokens (max_tokens) that does not fit is refused with 422 naming it and the limit; an
unset one is lowered to the room left; `truncate: true` keeps as many tokens as leave that room. Before,
such requests reached the model and failed with 500 mid-generation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from export import load_artifact, save_artifact
from model import ByteTokenizer
from tests.conftest import tiny_model
from tests.service.helpers import running_app

POSITIONS = 2048  # the shared tiny artifact's max_position_embeddings; one byte is one token


@pytest.fixture(scope="module")
def client(artifact: Any) -> Iterator[TestClient]:
    assert artifact.config.max_position_embeddings == POSITIONS
    # max_input_tokens unset: prompts may use every position, as in the reviewer's report.
    with running_app(artifact, backend="torch", max_new_tokens=64, log_level="warning") as c:
        yield c
        assert c.post("/generate", json={"inputs": "ok", "parameters": {"max_new_tokens": 1}}).status_code == 200


def generate(client: TestClient, prompt_tokens: int, path: str = "/generate", **parameters: Any) -> Any:
    body = {"inputs": "x" * prompt_tokens, "parameters": {"ignore_eos": True, "details": True, **parameters}}
    return client.post(path, json=body)


def too_long(r: Any, field: str) -> str:
    body = r.json()
    assert r.status_code == (422 if isinstance(body["error"], str) else 400), r.text  # /v1: OpenAI's 400
    message = body["error"] if isinstance(body["error"], str) else body["error"]["message"]
    error_type = body["error_type"] if isinstance(body["error"], str) else body["error"]["code"]
    # TGI answers a too-long input as "validation"; /v1 keeps the precise code
    assert error_type == ("validation" if isinstance(body["error"], str) else "input_too_long"), body
    assert field in message and str(POSITIONS) in message and "max_position_embeddings" in message, message
    return str(message)


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_prompt_plus_max_new_tokens_over_the_positions_is_refused(client: TestClient, path: str) -> None:
    message = too_long(generate(client, POSITIONS - 8, path, max_new_tokens=10), "parameters.max_new_tokens")
    assert f"given {POSITIONS - 8} inputs tokens and parameters.max_new_tokens=10" in message


def test_truncate_to_the_input_limit_leaves_no_room_for_new_tokens(client: TestClient) -> None:
    r = generate(client, POSITIONS + 500, truncate=POSITIONS, max_new_tokens=2)
    too_long(r, "parameters.max_new_tokens")


def test_exactly_filling_the_positions_is_served(client: TestClient) -> None:
    r = generate(client, POSITIONS - 8, max_new_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] == 8


def test_truncate_true_keeps_room_for_the_new_tokens(client: TestClient) -> None:
    r = generate(client, POSITIONS + 500, truncate=True, max_new_tokens=5)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    assert (details["prompt_tokens"], details["generated_tokens"]) == (POSITIONS - 5, 5)


def test_an_unset_max_new_tokens_is_lowered_to_the_room_left(client: TestClient) -> None:
    r = generate(client, POSITIONS - 3)  # the default would be 20 new tokens
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] == 3
    message = too_long(generate(client, POSITIONS), "parameters.max_new_tokens")
    assert "(the default)" in message


def test_completions_check_prompt_plus_max_tokens(client: TestClient) -> None:
    prompt = "x" * (POSITIONS - 8)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10, "ignore_eos": True})
    too_long(r, "max_tokens")
    assert r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/completions", json={"prompt": ["a", prompt], "max_tokens": 10, "stream": False})
    assert "prompt.1 tokens" in too_long(r, "max_tokens")
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10, "stream": True})
    too_long(r, "max_tokens")
    # Unset max_tokens (16, as OpenAI) is lowered to what fits.
    r = client.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == POSITIONS


def test_positions_the_padded_forward_pass_cannot_reach_are_not_offered(tmp_path: Path) -> None:
    """With 2044 positions and chunks of 8, a 2044-token sequence pads to 2048: the longest prompt is 2040."""
    save_artifact(tiny_model(max_position_embeddings=2044), tmp_path / "artifact", tokenizer=ByteTokenizer(),
                  provenance={"note": "random weights for tests"}, onnx=False)
    with running_app(load_artifact(tmp_path / "artifact"), backend="torch", log_level="warning") as c:
        assert c.get("/info").json()["limits"]["max_input_tokens"] == 2040
        r = c.post("/embed", json={"inputs": "x" * 2044})
        assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
        assert "2040" in r.json()["error"]
        assert c.post("/embed", json={"inputs": "x" * 2040}).status_code == 200
