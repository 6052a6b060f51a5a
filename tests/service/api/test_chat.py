"""`POST /v1/chat/completions` (and `/tokenize` with `messages`): the artifact's chat template rendered in a
sandbox, the prompt generated as `/v1/completions` generates it, chat's shapes (streaming too); an artifact
without a template answers 400 naming it; templates that fail or misbehave are the request's 4xx, never 5xx."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service.helpers import running_app, sse_events

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}"
            "{% endif %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}{{ greeting | default('') }}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
RENDERED = "[system] Be brief.\n[user] Tell me a story\n[assistant] "


@pytest.fixture(scope="module")
def client(artifact: Any) -> Any:
    with running_app(dataclasses.replace(artifact, chat_template=TEMPLATE), max_new_tokens=16,
                     max_input_tokens=256) as c:
        yield c


def completion_text(client: TestClient, prompt: str, **fields: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                             "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_chat_answers_what_completions_answers_for_the_rendered_prompt(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = completion_text(client, RENDERED)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected["choices"][0]["text"]}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == expected["usage"]
    assert "x-prompt-tokens" in r.headers


def test_max_completion_tokens_and_text_parts(client: TestClient) -> None:
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
             MESSAGES[1]]
    r = client.post("/v1/chat/completions", json={"messages": parts, "max_completion_tokens": 3,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    rendered = RENDERED.replace("Be brief.", "Be\nbrief.")
    assert r.json()["usage"]["prompt_tokens"] == len(rendered.encode())


def chat_texts(r: Any) -> list[str]:
    assert r.status_code == 200, r.text
    return [c["message"]["content"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def completion_texts(r: Any) -> list[str]:
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


@pytest.mark.parametrize("fields", [
    {"temperature": 1.0, "seed": 7},
    {"temperature": 1.5, "top_p": 0.5, "seed": 3},
    {"temperature": 1.0, "top_k": 2, "seed": 3},
    {"repetition_penalty": 3.0},
    {"frequency_penalty": 2.0},
    {"presence_penalty": 2.0},
    {"logit_bias": {"100": 100}},
    {"stop": ["e", "t"]},
    {"ignore_eos": False},
    {"truncate_prompt_tokens": 5},
    {"user": "someone"},
    {"n": 2, "temperature": 1.0, "seed": 5},
], ids=lambda fields: "+".join(fields))
def test_chat_takes_each_sampling_field_as_completions_does(client: TestClient, fields: dict[str, Any]) -> None:
    """Each field shared with /v1/completions reaches it as it is: the answer is completions' for the rendered
    prompt and the same field (test_parameter_effects.py and test_sampling_params.py show each one's effect)."""
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    chat = client.post("/v1/chat/completions", json={**base, **fields, "messages": MESSAGES})
    completion = client.post("/v1/completions", json={**base, **fields, "prompt": RENDERED})
    assert chat_texts(chat) == completion_texts(completion)
    assert chat.json()["usage"] == completion.json()["usage"]


def test_chat_names_this_servers_model_or_is_not_found(client: TestClient) -> None:
    model = client.get("/v1/models").json()["data"][0]["id"]
    assert client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1,
                                                     "model": model}).status_code == 200
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "long " * 200}]}),
    ("/v1/completions", {"prompt": ["long " * 200, "x"]}),
    ("/v1/embeddings", {"input": "long " * 200}),
])
def test_the_model_is_checked_before_anything_is_tokenized(client: TestClient, artifact: Any, path: str,
                                                           body: dict[str, Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A request for another model is 404 without its prompts tokenized: not the input_too_long its over-long
    prompt would get, and no call to the tokenizer."""
    calls: list[str] = []
    encode = type(artifact.tokenizer).encode
    monkeypatch.setattr(type(artifact.tokenizer), "encode", lambda self, text: calls.append(text) or encode(self, text))
    r = client.post(path, json={**body, "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert calls == []


def test_chat_without_a_token_limit_generates_into_the_room_left(artifact: Any) -> None:
    """Unset max_tokens: the room the prompt leaves in the model's positions, at most max_new_tokens (as vLLM),
    not OpenAI's 16 of /v1/completions; a prompt that fills every position is refused naming messages."""
    positions = artifact.config.max_position_embeddings
    with running_app(dataclasses.replace(artifact, chat_template="{{ messages[0].content }}"), max_new_tokens=40,
                     max_input_tokens=positions, max_wait_ms=0) as c:
        def generated(content: str) -> int:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                     "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
            return int(r.json()["usage"]["completion_tokens"])

        assert generated("Hi") == 40  # the server's max_new_tokens, not 16
        assert generated("x" * (positions - 18)) == 18  # the room left
        full = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * positions}]})
        assert full.status_code == 400 and full.json()["error"]["param"] == "messages", full.text
        assert "no room is left" in full.json()["error"]["message"]


def test_template_options_shape_the_chat_prompt(client: TestClient) -> None:
    def prompt_tokens(**fields: Any) -> int:
        r = client.post("/v1/chat/completions", json={"max_tokens": 1, **fields})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    assert prompt_tokens(messages=MESSAGES) == len(RENDERED.encode())
    assert prompt_tokens(messages=MESSAGES, add_generation_prompt=False) == len(RENDERED.encode()) - len("[assistant] ")
    final = [*MESSAGES, {"role": "assistant", "content": "Once"}]
    assert prompt_tokens(messages=final, add_generation_prompt=False, continue_final_message=True) \
        == len((RENDERED + "Once").encode())
    assert prompt_tokens(messages=MESSAGES, chat_template_kwargs={"greeting": "hi"}) == len(RENDERED.encode()) + 2
    named = [MESSAGES[0], {**MESSAGES[1], "name": "Ann"}]
    assert prompt_tokens(messages=named) == len(RENDERED.replace("[user]", "[user:Ann]").encode())


def test_chat_streams_chunks_with_the_role_first(client: TestClient) -> None:
    request = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]["content"]
    r = client.post("/v1/chat/completions", json={**request, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    with_usage = sse_events(client.post("/v1/chat/completions", json={
        **request, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert with_usage[-1] == "[DONE]" and with_usage[-2]["choices"] == []
    assert with_usage[-2]["usage"]["completion_tokens"] == 6
    assert "".join(c["choices"][0]["delta"]["content"] for c in with_usage[:-2]) == whole


def test_chat_logprobs_come_per_token(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                                  "ignore_eos": True, "logprobs": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(entry["logprob"] <= 0 for entry in content)
    top = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                                    "ignore_eos": True, "logprobs": True, "top_logprobs": 3})
    for entry in top.json()["choices"][0]["logprobs"]["content"]:
        assert 3 <= len(entry["top_logprobs"]) <= 4  # the chosen token's beside the 3 likeliest
        # greedy: the chosen token is the likeliest of its alternatives
        assert max(t["logprob"] for t in entry["top_logprobs"]) == pytest.approx(entry["logprob"])
    assert "".join(entry["token"] for entry in content) == r.json()["choices"][0]["message"]["content"]


def test_tokenize_with_messages_uses_the_same_template(client: TestClient, artifact: Any) -> None:
    r = client.post("/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == artifact.tokenizer.encode(RENDERED)
    open_turn = client.post("/tokenize", json={"messages": [*MESSAGES, {"role": "assistant", "content": "Once"}],
                                               "add_generation_prompt": False, "continue_final_message": True})
    assert open_turn.json()["tokens"] == artifact.tokenizer.encode(RENDERED + "Once")
    assert client.get("/tokenizer_info").json()["chat_template"] == TEMPLATE


def test_template_variables_come_from_chat_template_kwargs(client: TestClient, artifact: Any) -> None:
    r = client.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"greeting": "hi"}})
    assert r.json()["tokens"] == artifact.tokenizer.encode(RENDERED + "hi")
    r = client.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"messages": []}})
    assert r.status_code // 100 == 4 and "chat_template_kwargs" in r.text


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # the template's raise_exception
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": "hello"}, "messages"),
    ({"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
    ({"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 3}, "max_completion_tokens"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "tools": []}, "tools"),
    # nested deeper than anything walks safely (it was a RecursionError: 500)
    ({"messages": MESSAGES, "chat_template_kwargs": {"a": json.loads('{"a":' * 800 + "1" + "}" * 800)}},
     "chat_template_kwargs"),
])
def test_bad_chat_requests_are_refused_by_name(client: TestClient, body: dict[str, Any], param: str) -> None:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code // 100 == 4, r.text
    error = r.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error


def test_a_template_that_reaches_outside_the_sandbox_is_refused(artifact: Any) -> None:
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with running_app(dataclasses.replace(artifact, chat_template=escape), max_new_tokens=4) as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code // 100 == 4 and r.json()["error"]["param"] == "messages", r.text


def test_without_a_template_chat_answers_400_naming_it(artifact: Any) -> None:
    with running_app(artifact, max_new_tokens=4) as c:
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert r.status_code // 100 == 4, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and "chat template" in error["message"]
        r = c.post("/tokenize", json={"messages": MESSAGES})
        assert r.status_code // 100 == 4 and "chat template" in r.json()["error"]


def test_the_openai_client_chats_streams_and_raises_bad_request(client: TestClient, artifact: Any) -> None:
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    model = client.get("/v1/models").json()["data"][0]["id"]
    answer = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0)  # type: ignore[arg-type]
    assert answer.choices[0].message.role == "assistant" and answer.usage is not None
    assert answer.usage.completion_tokens == answer.usage.total_tokens - answer.usage.prompt_tokens
    pieces = api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                         stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
    assert streamed == answer.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=model, messages=[{"role": "tool", "content": "x",  # type: ignore[list-item]
                                                             "tool_call_id": "1"}])
    with running_app(artifact, max_new_tokens=4) as plain:
        bare = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=plain, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="chat template"):
            bare.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]


_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
_CONTENT = st.one_of(st.none(), _TEXT, st.integers(), st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "x"]), "text": _TEXT}), max_size=3))
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]),
                           "content": _CONTENT}, optional={"name": st.one_of(_TEXT, st.integers())}),
    _TEXT, st.integers(), st.none())


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(messages=st.one_of(st.lists(_MESSAGE, max_size=4), _TEXT, st.none()),
       extra=st.fixed_dictionaries({}, optional={
           "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
           "chat_template_kwargs": st.one_of(st.none(), st.dictionaries(_TEXT, _TEXT, max_size=2)),
           "max_tokens": st.integers(-1, 3), "top_logprobs": st.integers(-1, 25), "logprobs": st.booleans()}))
def test_chat_messages_of_any_shape_get_an_answer_or_a_4xx(client: TestClient, messages: Any,
                                                           extra: dict[str, Any]) -> None:
    for route in ("/v1/chat/completions", "/tokenize"):
        chat_only = ("max_tokens", "top_logprobs", "logprobs") if route == "/tokenize" else ()
        body = {"messages": messages, **{k: v for k, v in extra.items() if k not in chat_only}}
        r = client.post(route, json=body)
        assert r.status_code == 200 or 400 <= r.status_code < 500, (route, body, r.status_code, r.text)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x", "name": "a\x00b"}]}, "messages.0.name"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"greeting": {"deep": ["a\x00"]}}}, "chat_template_kwargs"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"k\x00": 1}}, "chat_template_kwargs"),
])
def test_names_and_template_variables_are_text_as_the_messages_are(client: TestClient, body: dict[str, Any],
                                                                   param: str) -> None:
    """NUL is refused in every string the template writes into the prompt, as in the messages: in enwik8's byte
    vocabulary it is the end-of-text id."""
    for path in ("/v1/chat/completions", "/tokenize"):
        r = client.post(path, json=body)
        assert r.status_code in (400, 422) and "NUL" in r.text, r.text
        if path.startswith("/v1"):
            assert r.json()["error"]["param"] == param
