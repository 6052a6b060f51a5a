"""Sampling parameters as the clients mean them, through the routes: TGI's warpers turn sampling on, OpenAI's
temperature 0 is greedy, penalties and logit_bias change the tokens, n and best_of give reproducible choices."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from model.sampling import choice_seed
from tests.service.helpers import running_app

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(artifact: Any) -> Iterator[TestClient]:
    with running_app(artifact, backend="torch", max_wait_ms=0, max_new_tokens=16) as c:
        yield c


def tgi_text(client: TestClient, **parameters: Any) -> str:
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 8, **parameters}})
    assert r.status_code == 200, r.text
    return str(r.json()["generated_text"])


def completion(client: TestClient, **fields: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("warper", [{"temperature": 1.5}, {"top_k": 50}, {"top_p": 0.99}, {"typical_p": 0.99},
                                    {"do_sample": True}])
def test_a_tgi_warper_samples_without_do_sample(client: TestClient, warper: dict[str, Any]) -> None:
    greedy = tgi_text(client)
    assert {tgi_text(client, seed=s) for s in range(3)} == {greedy}  # no warper, no do_sample: greedy
    sampled = {tgi_text(client, seed=s, **warper) for s in range(6)}
    assert len(sampled) > 1
    assert tgi_text(client, seed=4, **warper) == tgi_text(client, seed=4, **warper)  # and seeded


def test_openai_temperature_0_is_greedy(client: TestClient) -> None:
    greedy = tgi_text(client, max_new_tokens=8, ignore_eos=True)
    texts = {completion(client, temperature=0, seed=s)["choices"][0]["text"] for s in range(3)}
    assert texts == {greedy}
    assert len({completion(client, temperature=1.5, seed=s)["choices"][0]["text"] for s in range(6)}) > 1


def test_logit_bias_forces_and_forbids_tokens(client: TestClient, artifact: Any) -> None:
    forced = artifact.tokenizer.encode("q")[0]
    text = completion(client, temperature=0, logit_bias={str(forced): 100})["choices"][0]["text"]
    assert text == "q" * 8
    # every byte outside ASCII banned: the text decodes byte for byte, so its tokens can be read back
    ascii_only = {str(i): -100 for i in range(258) if not artifact.tokenizer.decode([i]).isascii()}
    greedy = completion(client, temperature=0, logit_bias=ascii_only)["choices"][0]["text"]
    assert greedy.isascii() and len(artifact.tokenizer.encode(greedy)) == 8
    first = artifact.tokenizer.encode(greedy)[0]
    banned = completion(client, temperature=0, logit_bias={**ascii_only, str(first): -100})["choices"][0]["text"]
    assert banned != greedy and first not in artifact.tokenizer.encode(banned)


# a key of 5,000 digits passes isdigit() and then made int() raise (a 500); "²" and "٣" are digits to isdigit()
@pytest.mark.parametrize("bias", [{"x": 1}, {"-1": 1}, {"258": 1}, {"1": 101}, {"1": "a"}, {"9" * 5000: 1},
                                  {"1" + "0" * 4400: 1}, {"²": 1}, {"٣": 1}, {"1_0": 1}, {" 1": 1}, {"": 1}])
def test_bad_logit_bias_is_refused_by_name(client: TestClient, bias: dict[str, Any]) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "logit_bias": bias})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("logit_bias"), r.text


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_change_a_repetitive_greedy_text(client: TestClient, penalty: str, artifact: Any) -> None:
    plain = completion(client, temperature=0, max_tokens=16)["choices"][0]["text"]
    ids = artifact.tokenizer.encode(plain)
    assert len(set(ids)) < len(ids)  # the tiny model repeats itself: something to penalise
    penalised = completion(client, temperature=0, max_tokens=16, **{penalty: 2.0})["choices"][0]["text"]
    assert penalised != plain
    if penalty == "presence_penalty":
        assert len(set(artifact.tokenizer.encode(penalised))) > len(set(ids))
    tgi = tgi_text(client, max_new_tokens=16, ignore_eos=True, frequency_penalty=2.0)
    assert tgi == completion(client, temperature=0, max_tokens=16, frequency_penalty=2.0)["choices"][0]["text"]


def test_n_choices_are_each_reproduced_alone(client: TestClient) -> None:
    body = completion(client, n=3, seed=11, temperature=1.2, logprobs=0)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["seeds"] == [choice_seed(11, i) for i in range(3)] and body["seeds"][0] == 11
    for choice, seed in zip(body["choices"], body["seeds"], strict=True):
        alone = completion(client, n=1, seed=seed, temperature=1.2)["choices"][0]
        assert alone["text"] == choice["text"]
    assert len({c["text"] for c in body["choices"]}) > 1
    again = completion(client, n=3, seed=11, temperature=1.2, logprobs=0)
    assert again["choices"] == body["choices"]
    two = completion(client, prompt=[PROMPT, "Hello"], n=2, seed=5, temperature=1.2)
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]


def test_best_of_answers_the_highest_summed_logprob(client: TestClient) -> None:
    every = completion(client, n=3, seed=7, temperature=1.2, logprobs=0)["choices"]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    best = completion(client, n=1, best_of=3, seed=7, temperature=1.2)["choices"]
    assert len(best) == 1 and best[0]["text"] == every[sums.index(max(sums))]["text"]
    r = client.post("/v1/completions", json={"prompt": PROMPT, "n": 3, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_tgi_best_of_returns_the_others_in_details(client: TestClient) -> None:
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "best_of": 3, "do_sample": True, "seed": 3, "details": True}})
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    others = details["best_of_sequences"]
    assert len(others) == 2
    seeds = {details["seed"], *(o["seed"] for o in others)}
    assert seeds == {choice_seed(3, i) for i in range(3)}
    best = sum(t["logprob"] for t in details["tokens"])
    assert all(best >= sum(t["logprob"] for t in o["tokens"]) for o in others)
    alone = client.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "do_sample": True, "seed": details["seed"]}})
    assert alone.json()["generated_text"] == r.json()["generated_text"]


@pytest.mark.parametrize("parameters, field", [
    ({"best_of": 2}, "best_of"),  # needs sampling
    ({"best_of": 5, "do_sample": True}, "best_of"),  # over max_best_of
    ({"watermark": True}, "watermark"),
    ({"grammar": {"type": "json", "value": {"type": "strng"}}}, "grammar"),  # a schema the engine refuses
    ({"adapter_id": "x"}, "adapter_id"),
    ({"top_n_tokens": 21}, "top_n_tokens"),
])
def test_tgi_refuses_what_it_cannot_honour_by_name(client: TestClient, parameters: dict[str, Any],
                                                   field: str) -> None:
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": parameters})
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and field in r.json()["error"], r.text


def test_best_of_is_refused_when_streaming(client: TestClient) -> None:
    r = client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}})
    assert r.status_code == 422 and "best_of" in r.json()["error"]
    r = client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"decoder_input_details": True}})
    assert r.status_code == 422 and "decoder_input_details" in r.json()["error"]
    r = client.post("/generate", json={"inputs": PROMPT, "stream": True})
    assert r.status_code == 422 and "stream" in r.json()["error"]
