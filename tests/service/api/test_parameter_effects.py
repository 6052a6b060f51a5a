"""The effect of each parameter the other route tests do not show: stop sequences, ignore_eos, top_k and top_p on
/v1, repetition_penalty, truncate_prompt_tokens, /v1/embeddings dimensions, /embed normalize."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.service.helpers import running_app

PROMPT = "Once upon a time"
EOS = {"1": 100.0}  # the end-of-text token (ByteTokenizer's id 1) made all but certain


@pytest.fixture(scope="module")
def client(artifact: Any) -> Iterator[TestClient]:
    with running_app(artifact, backend="torch", max_wait_ms=0, max_new_tokens=16) as c:
        yield c


def completion(client: TestClient, **fields: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, **fields})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_stop_sequences_end_the_text_on_both_routes(client: TestClient) -> None:
    greedy = completion(client, temperature=0, ignore_eos=True, max_tokens=12)["choices"][0]["text"]
    stop = greedy[4:6]
    assert stop and stop not in greedy[:5]
    cut = completion(client, temperature=0, ignore_eos=True, max_tokens=12, stop=[stop])["choices"][0]
    assert cut["text"] == greedy[:greedy.index(stop)] and cut["finish_reason"] == "stop"
    tgi = client.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 12, "ignore_eos": True, "stop": [stop], "details": True}}).json()
    assert tgi["generated_text"].endswith(stop) and tgi["details"]["finish_reason"] == "stop_sequence"


def test_a_stop_sequence_in_the_last_token_ends_the_text_there(client: TestClient) -> None:
    """The token that reaches max_tokens is checked for stop sequences too (vLLM checks them before max_tokens):
    OpenAI cuts the text at it and says stop, TGI ends with it and says stop_sequence."""
    greedy = completion(client, temperature=0, ignore_eos=True, max_tokens=10)["choices"][0]["text"]
    stop = greedy[-1]
    first = greedy.index(stop)
    cut = completion(client, temperature=0, ignore_eos=True, max_tokens=first + 1, stop=[stop])["choices"][0]
    assert cut["text"] == greedy[:first] and cut["finish_reason"] == "stop", (greedy, cut)
    tgi = client.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": first + 1, "ignore_eos": True, "stop": [stop], "details": True}}).json()
    assert tgi["generated_text"] == greedy[:first + 1] and tgi["details"]["finish_reason"] == "stop_sequence"


def test_ignore_eos_generates_past_the_end_of_text(client: TestClient) -> None:
    stopped = completion(client, temperature=0, logit_bias=EOS)
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    kept = completion(client, temperature=0, logit_bias=EOS, ignore_eos=True)
    assert kept["usage"]["completion_tokens"] == 8 and kept["choices"][0]["finish_reason"] == "length"


def test_top_k_1_and_a_tiny_top_p_keep_only_the_likeliest_token(client: TestClient) -> None:
    greedy = completion(client, temperature=0, ignore_eos=True)["choices"][0]["text"]
    for filtered in ({"top_k": 1}, {"top_p": 1e-9}):
        texts = {completion(client, temperature=1.5, seed=s, ignore_eos=True, **filtered)["choices"][0]["text"]
                 for s in range(4)}
        assert texts == {greedy}, filtered
    assert len({completion(client, temperature=1.5, seed=s, ignore_eos=True, top_k=0)["choices"][0]["text"]
                for s in range(4)}) > 1


def test_repetition_penalty_changes_a_repetitive_greedy_text(client: TestClient) -> None:
    plain = completion(client, temperature=0, ignore_eos=True, max_tokens=16)["choices"][0]["text"]
    penalised = completion(client, temperature=0, ignore_eos=True, max_tokens=16,
                           repetition_penalty=3.0)["choices"][0]["text"]
    assert penalised != plain
    tgi = client.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 16, "ignore_eos": True, "repetition_penalty": 3.0}}).json()["generated_text"]
    assert tgi == penalised


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: TestClient) -> None:
    body = completion(client, truncate_prompt_tokens=4, echo=True, max_tokens=0)
    assert body["usage"]["prompt_tokens"] == 4 and body["choices"][0]["text"] == PROMPT[-4:]


def test_embeddings_dimensions_must_be_the_models(client: TestClient) -> None:
    size = len(client.post("/v1/embeddings", json={"input": "a"}).json()["data"][0]["embedding"])
    assert client.post("/v1/embeddings", json={"input": "a", "dimensions": size}).status_code == 200
    r = client.post("/v1/embeddings", json={"input": "a", "dimensions": size - 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_embed_normalize_false_keeps_the_raw_length(client: TestClient) -> None:
    unit = client.post("/embed", json={"inputs": "some text"}).json()[0]
    raw = client.post("/embed", json={"inputs": "some text", "normalize": False}).json()[0]
    assert math.isclose(math.hypot(*unit), 1.0, rel_tol=1e-5)
    assert not math.isclose(math.hypot(*raw), 1.0, rel_tol=1e-3)
    scale = math.hypot(*raw)
    assert [v / scale for v in raw] == pytest.approx(unit, abs=1e-5)
