"""The official `openai` client against the app (its HTTP client is the in-process TestClient): invalid input
raises BadRequestError, an unknown model NotFoundError, and what lm-eval and perplexity tools ask for (echo
with logprobs, max_tokens 0, n, logprobs up to 20, usage at a stream's end) comes back in its types."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from tests.service.helpers import running_app


@pytest.fixture(scope="module")
def client(artifact: Any) -> Iterator[openai.OpenAI]:
    with running_app(artifact, backend="torch", max_wait_ms=0, max_new_tokens=16) as http:
        assert isinstance(http, TestClient)
        model = http.get("/v1/models").json()["data"][0]["id"]
        api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        api.served_model = model  # type: ignore[attr-defined]
        yield api


def model_of(client: openai.OpenAI) -> str:
    return str(client.served_model)  # type: ignore[attr-defined]


@pytest.mark.parametrize("fields", [{"temperature": -1}, {"logprobs": 21}, {"n": 0}, {"top_p": 0},
                                    {"logit_bias": {"x": 1}}, {"max_tokens": 0}, {"extra_body": {"min_p": 0.1}}])
def test_invalid_requests_raise_bad_request(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=model_of(client), prompt="Hi", **fields)
    assert raised.value.status_code == 400 and raised.value.body is not None


def test_an_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)


def test_echo_scores_the_prompt_and_n_gives_choices(client: openai.OpenAI) -> None:
    scored = client.completions.create(model=model_of(client), prompt="Hello there", echo=True, logprobs=1,
                                       max_tokens=0)
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len("Hello there")
    assert scored.choices[0].text == "Hello there"
    several = client.completions.create(model=model_of(client), prompt="Hi", n=2, max_tokens=3, seed=1,
                                        logprobs=20)
    assert [c.index for c in several.choices] == [0, 1]
    top = several.choices[0].logprobs.top_logprobs  # type: ignore[union-attr]
    assert top is not None and all(len(t) >= 20 for t in top)


def test_a_stream_ends_with_usage_when_asked(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {"model": model_of(client), "prompt": "Hi", "max_tokens": 3, "temperature": 0,
                              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**fields)
    chunks = list(client.completions.create(**fields, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == whole.usage.model_dump()  # type: ignore[union-attr]
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
