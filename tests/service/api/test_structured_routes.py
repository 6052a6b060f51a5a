"""Structured output through every generation route and every client's spelling: the text always matches the
constraint (a random model's tokens, so only the mask makes it so), streams too, with logprobs, stop sequences,
n and max_tokens keeping their meaning, and `finish_reason: length` when the budget ends inside the structure."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.service.api.test_chat import TEMPLATE
from tests.service.helpers import running_app, sse_events

PROMPT = "Once upon a time"
# A schema a random model completes in a few tokens: compact JSON leaves it only true or false to choose
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}
REGEX = "[0-9]{3}-[a-z]{2}"
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def client(artifact: Any) -> Iterator[TestClient]:
    with running_app(dataclasses.replace(artifact, chat_template=TEMPLATE), backend="torch", max_wait_ms=0,
                     max_new_tokens=64, max_input_tokens=256) as c:
        yield c


def completion(client: TestClient, **fields: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 32, **fields})
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def chat(client: TestClient, **fields: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Answer in JSON"}], "max_tokens": 32, **fields})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"]}


def tgi(client: TestClient, grammar: dict[str, Any], **parameters: Any) -> dict[str, Any]:
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 32, "details": True, "grammar": grammar, **parameters}})
    assert r.status_code == 200, r.text
    return {"text": r.json()["generated_text"], "finish_reason": r.json()["details"]["finish_reason"]}


def is_flag(text: str) -> bool:
    return json.loads(text) in ({"ok": True}, {"ok": False})


# Each client's spelling of each constraint: (field values, what the text must satisfy)
OPENAI_SPELLINGS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG, "strict": True}}},
     is_flag),
    ({"structured_outputs": {"json": FLAG}}, is_flag),
    ({"structured_outputs": {"json": json.dumps(FLAG)}}, is_flag),
    ({"guided_json": FLAG}, is_flag),
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) is not None),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),  # GBNF
]


@pytest.mark.parametrize("fields, valid", OPENAI_SPELLINGS)
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_openai_and_vllm_spellings_constrain_both_routes(client: TestClient, fields: dict[str, Any], valid: Any,
                                                         route: str) -> None:
    for seed in range(3):
        answer = (completion if route == "completions" else chat)(client, temperature=1, seed=seed, **fields)
        assert valid(answer["text"]), answer
        assert answer["finish_reason"] == "stop"


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_json_object_is_any_object_even_against_a_bias(client: TestClient, artifact: Any, route: str) -> None:
    # the bias pushes `}` first, which the mask forbids until `{` opens the object; then it closes it
    brace = {str(artifact.tokenizer.encode("}")[0]): 100}
    for fields in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}):
        answer = (completion if route == "completions" else chat)(client, logit_bias=brace, **fields)
        assert (answer["text"], answer["finish_reason"]) == ("{}", "stop")
    unconstrained = completion(client, logit_bias=brace, response_format={"type": "text"}, max_tokens=3)
    assert unconstrained["text"] == "}}}"


@pytest.mark.parametrize("grammar, valid", [
    ({"type": "json", "value": FLAG}, is_flag),
    ({"type": "json", "value": json.dumps(FLAG)}, is_flag),
    ({"type": "json_schema", "value": {"name": "flag", "schema": FLAG}}, is_flag),
    ({"type": "regex", "value": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
])
def test_tgi_grammar_constrains_generate(client: TestClient, grammar: dict[str, Any], valid: Any) -> None:
    for seed in range(3):
        answer = tgi(client, grammar, do_sample=True, seed=seed)
        assert valid(answer["text"]) and answer["finish_reason"] == "eos_token", answer


def test_streams_carry_the_constrained_text(client: TestClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 32, "stream": True, "guided_regex": REGEX, "temperature": 1, "seed": 5}
    events = sse_events(client.post("/v1/completions", json=body).text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert re.fullmatch(REGEX, text) and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert text == completion(client, guided_regex=REGEX, temperature=1, seed=5)["text"]
    chat_events = sse_events(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Pick"}], "stream": True, "guided_choice": CHOICES}).text)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chat_events[:-1]) in CHOICES
    tgi_events = sse_events(client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 32, "grammar": {"type": "regex", "value": REGEX}}}).text)
    assert re.fullmatch(REGEX, tgi_events[-1]["generated_text"])
    assert "".join(e["token"]["text"] for e in tgi_events) == tgi_events[-1]["generated_text"]


def test_the_budget_ending_inside_the_structure_is_length(client: TestClient) -> None:
    long = {"type": "object", "properties": {"name": {"type": "string", "minLength": 20}}, "required": ["name"]}
    answer = completion(client, guided_json=long, max_tokens=5)
    assert answer["finish_reason"] == "length" and answer["text"] == '{"nam'  # only the schema's key could come
    assert tgi(client, {"type": "json", "value": long}, max_new_tokens=5)["finish_reason"] == "length"


def test_logprobs_are_those_of_the_masked_distribution(client: TestClient) -> None:
    answer = completion(client, guided_regex="[ab]{6}", temperature=1, seed=3, logprobs=5)
    assert re.fullmatch("[ab]{6}", answer["text"])
    for alternatives in answer["logprobs"]["top_logprobs"]:
        assert set(alternatives) <= {"a", "b"}  # the other tokens have no probability left
        assert sum(2.718281828459045 ** v for v in alternatives.values()) == pytest.approx(1.0, abs=1e-5)


def test_stop_sequences_still_end_the_text(client: TestClient) -> None:
    answer = completion(client, guided_regex="a{3}b{3}", stop=["b"])
    assert (answer["text"], answer["finish_reason"]) == ("aaa", "stop")
    tgi_answer = tgi(client, {"type": "regex", "value": "a{3}b{3}"}, stop=["ab"])
    assert tgi_answer == {"text": "aaab", "finish_reason": "stop_sequence"}


def test_n_choices_each_match_and_each_is_reproduced_alone(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 32, "n": 3, "temperature": 1,
                                             "seed": 11, "guided_json": FLAG, "logprobs": 1})
    assert r.status_code == 200, r.text
    together = r.json()
    for choice, seed in zip(together["choices"], together["seeds"], strict=True):
        assert is_flag(choice["text"])
        alone = completion(client, temperature=1, seed=seed, guided_json=FLAG, logprobs=1)
        assert alone["text"] == choice["text"]
        assert alone["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"]
    # best_of ranks constrained sequences by their summed logprob as it ranks any
    best = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 32, "n": 1, "best_of": 3,
                                                "temperature": 1, "seed": 11, "guided_json": FLAG, "logprobs": 1})
    assert best.status_code == 200, best.text
    sums = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in together["choices"]}
    assert best.json()["choices"][0]["text"] == max(sums, key=lambda t: sums[t])
    tgi_best = client.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 32, "best_of": 2, "do_sample": True, "seed": 11, "details": True,
        "grammar": {"type": "json", "value": FLAG}}}).json()
    assert is_flag(tgi_best["generated_text"])
    assert all(is_flag(o["generated_text"]) for o in tgi_best["details"]["best_of_sequences"])


def test_the_openai_client_sends_response_format(client: TestClient) -> None:
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    reply = api.chat.completions.create(
        model=client.get("/v1/models").json()["data"][0]["id"], max_tokens=32,
        messages=[{"role": "user", "content": "Is it ok?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG, "strict": True}})
    assert is_flag(reply.choices[0].message.content or "") and reply.choices[0].finish_reason == "stop"
    text = api.completions.create(model=reply.model, prompt=PROMPT, max_tokens=8,
                                  extra_body={"guided_choice": CHOICES}).choices[0].text
    assert text in CHOICES


def test_huggingface_hubs_inference_client_sends_a_grammar(server_factory: Any) -> None:
    hub = pytest.importorskip("huggingface_hub")
    server = server_factory(backend="torch", max_new_tokens=32)
    client = hub.InferenceClient(server.url)
    text = client.text_generation(PROMPT, max_new_tokens=32, grammar={"type": "json", "value": FLAG})
    assert is_flag(text)
    regex = client.text_generation(PROMPT, max_new_tokens=32, grammar={"type": "regex", "value": REGEX})
    assert re.fullmatch(REGEX, regex)


def test_a_prompt_read_by_decode_steps_is_not_masked(client: TestClient) -> None:
    # cache_prefix_chars: the prompt after its first 5 characters is fed through decode steps, rows the masks
    # skip; only the generated tokens advance the matcher (were the prompt's, the regex would refuse them)
    first = completion(client, guided_regex=REGEX, temperature=1, seed=9, cache_prefix_chars=5)
    again = completion(client, guided_regex=REGEX, temperature=1, seed=9, cache_prefix_chars=5)  # a cache hit
    assert re.fullmatch(REGEX, first["text"]) and again["text"] == first["text"]
