"""Logprobs as the clients ask for them: OpenAI's alternatives and echo (a prompt scored by its prefill, the
first token without a logprob; max_tokens 0 scores without generating), in streams too; TGI's top_n_tokens
and decoder_input_details (details.prefill). Under both prefills: a prompt is scored with the semantics its
prefill reads it with (one-piece: the model's forward; causal: one decode step per token,
tests/service/api/test_causal_scoring.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from service.api.protocol.logprobs import token_key
from tests.service.helpers import running_app, sse_events, stepped_logprobs

PROMPT = "The quick brown fox jumps"


@pytest.fixture(scope="module", params=["one-piece", "causal"])
def client(artifact: Any, request: pytest.FixtureRequest) -> Iterator[TestClient]:
    with running_app(artifact, backend="torch", max_wait_ms=0, max_new_tokens=16, prefill=request.param) as c:
        assert c.get("/info").json()["batching"]["prefill"] == request.param
        yield c


def forward_logprobs(artifact: Any, text: str, client: TestClient) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and each position's next-token log-probabilities as the server's prefill reads it: the
    model's own forward (one-piece), or one decode step per token (causal)."""
    ids = artifact.tokenizer.encode(text)
    if client.get("/info").json()["batching"]["prefill"] == "causal":
        return ids, stepped_logprobs(artifact.model, ids)
    with torch.no_grad():
        logits = artifact.model(torch.tensor([ids])).logits[0].float()  # (L, vocab)
    return ids, torch.log_softmax(logits, dim=-1)


def test_echo_with_max_tokens_0_scores_the_prompt_as_its_prefill_reads_it(client: TestClient, artifact: Any) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0
    ids, logprobs = forward_logprobs(artifact, PROMPT, client)
    got = choice["logprobs"]
    assert "".join(got["tokens"]) == PROMPT and len(got["tokens"]) == len(ids)
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    expected = logprobs[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(got["token_logprobs"][1:]), expected, rtol=1e-4, atol=1e-4)
    assert got["text_offset"] == list(range(len(PROMPT)))  # one byte, one character each
    for position, top in enumerate(got["top_logprobs"][1:]):
        best = logprobs[position].topk(2)
        wanted = {token_key(artifact.tokenizer, i) for i in best.indices.tolist()}
        assert wanted <= set(top) and len(top) <= 3  # the 2 alternatives and the chosen token


def test_echo_with_one_token_is_what_lm_eval_asks(client: TestClient, artifact: Any) -> None:
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    ids, _ = forward_logprobs(artifact, PROMPT, client)
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 1
    assert choice["text"].startswith(PROMPT) and choice["logprobs"]["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in choice["logprobs"]["token_logprobs"][1:])


def test_logprobs_up_to_20_alternatives_and_refused_beyond(client: TestClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 20, "temperature": 0, "ignore_eos": True}
    got = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(got["tokens"]) == 3
    for value, top in zip(got["token_logprobs"], got["top_logprobs"], strict=True):
        assert len(top) == 20 and value == pytest.approx(max(top.values()))  # greedy: chosen is the likeliest
    r = client.post("/v1/completions", json={**body, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_a_stream_carries_the_same_logprobs_and_ends_with_usage(client: TestClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "logprobs": 3, "temperature": 0, "ignore_eos": True, "echo": True}
    whole = client.post("/v1/completions", json=body).json()
    events = sse_events(client.post("/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    chunks = [e["choices"][0] for e in events[:-2]]
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in streamed:
            streamed[key].extend(c["logprobs"][key])
    assert streamed == whole["choices"][0]["logprobs"]
    plain = sse_events(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert all(e == "[DONE]" or e["choices"] for e in plain)  # no usage chunk unless asked


def test_tgi_top_n_tokens_and_prefill_details(client: TestClient, artifact: Any) -> None:
    parameters = {"max_new_tokens": 4, "details": True, "decoder_input_details": True, "top_n_tokens": 3}
    details = client.post("/generate", json={"inputs": PROMPT, "parameters": parameters}).json()["details"]
    ids, logprobs = forward_logprobs(artifact, PROMPT, client)
    prefill = details["prefill"]
    assert [t["id"] for t in prefill] == ids and prefill[0]["logprob"] is None
    assert "".join(t["text"] for t in prefill) == PROMPT
    expected = logprobs[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor([t["logprob"] for t in prefill[1:]]), expected, rtol=1e-4, atol=1e-4)
    assert len(details["top_tokens"]) == len(details["tokens"]) == 4
    for token, top in zip(details["tokens"], details["top_tokens"], strict=True):
        assert len(top) == 3 and top[0]["id"] == token["id"]  # greedy: the chosen token is the most likely
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
    plain = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "details": True}})
    assert plain.json()["details"]["prefill"] == [] and "top_tokens" not in plain.json()["details"]


def test_tgi_stream_events_carry_top_tokens(client: TestClient) -> None:
    parameters = {"max_new_tokens": 3, "top_n_tokens": 2}
    events = sse_events(client.post("/generate_stream", json={"inputs": PROMPT, "parameters": parameters}).text)
    assert len(events) == 3 and all(len(e["top_tokens"]) == 2 for e in events)
    plain = sse_events(client.post("/generate_stream", json={"inputs": PROMPT,
                                                             "parameters": {"max_new_tokens": 2}}).text)
    assert all("top_tokens" not in e for e in plain)


def test_max_tokens_0_needs_echo(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
