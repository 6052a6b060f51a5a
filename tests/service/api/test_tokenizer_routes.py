"""Tokens in and out: vLLM's `/tokenize` (`prompt`), `/detokenize` and `/tokenizer_info`, TGI's `/tokenize`
(`inputs`) beside them, and OpenAI prompts given as token ids (a list, a list of lists), out-of-range and
wrongly typed ids refused by name."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.routes.tokenize import with_bos
from tests.service.helpers import running_app


@pytest.fixture(scope="module")
def client(artifact: Any) -> Any:
    with running_app(artifact, max_new_tokens=16, max_input_tokens=64, max_client_batch_size=4) as c:
        yield c


def error_of(r: Any, status_family: int, param: str) -> dict[str, Any]:
    """The error body of a 4xx response (OpenAI's shape on /v1, the native shape elsewhere), checked to name
    `param`."""
    assert r.status_code // 100 == status_family, r.text
    body = r.json()
    error = body["error"]
    if isinstance(error, dict):
        assert error["param"] == param, error
        return dict(error)
    assert param in error, body
    return dict(body)


def test_vllm_tokenize_answers_ids_count_and_model_length(client: TestClient, artifact: Any) -> None:
    tok = artifact.tokenizer
    r = client.post("/tokenize", json={"prompt": "héllo", "add_special_tokens": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("héllo")
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert body["token_strs"] is None
    with_strs = client.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}).json()
    assert with_strs["token_strs"] == [tok.id_to_piece(i) for i in tok.encode("ab")]


def test_vllm_tokenize_takes_whole_documents_longer_than_the_input_limit(client: TestClient) -> None:
    text = "a long document. " * 20  # 340 tokens; the input limit is 64
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["count"] == len(text.encode())


def test_tgi_tokenize_keeps_its_shape(client: TestClient) -> None:
    pieces = client.post("/tokenize", json={"inputs": "hé", "add_special_tokens": True}).json()
    assert [(p["text"], p["start"], p["stop"]) for p in pieces] == [("h", 0, 1), ("é", 1, 2), ("é", 1, 2)]


@pytest.mark.parametrize("body, param", [
    ({}, "none"),
    ({"inputs": "a", "prompt": "a"}, "inputs, prompt"),
    ({"inputs": "a", "return_token_strs": True}, "return_token_strs"),
    ({"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"prompt": "a", "temperature": 1.0}, "temperature"),
])
def test_tokenize_refuses_mixed_or_malformed_bodies_by_name(client: TestClient, body: dict[str, Any],
                                                            param: str) -> None:
    r = client.post("/tokenize", json=body)
    assert r.status_code // 100 == 4 and param in r.json()["error"], r.text


def test_detokenize_inverts_tokenize(client: TestClient) -> None:
    text = "Round trip: ünïcödé ✓"
    ids = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("tokens, param", [
    ([65, 100000], "tokens.1"),
    ([-1], "tokens.0"),
    ([65, "66"], "tokens.1"),
    ([65, True], "tokens.1"),
    ([65, 1.5], "tokens.1"),
    ("abc", "tokens"),
])
def test_detokenize_refuses_ids_outside_the_vocabulary_or_not_ids(client: TestClient, tokens: Any,
                                                                  param: str) -> None:
    r = client.post("/detokenize", json={"tokens": tokens})
    assert r.status_code // 100 == 4 and param in r.json()["error"], r.text


def test_tokenizer_info_names_the_special_tokens_and_the_model_length(client: TestClient, artifact: Any) -> None:
    tok = artifact.tokenizer
    info = client.get("/tokenizer_info").json()
    assert info["eos_token_id"] == tok.eos_id and info["eos_token"] == tok.id_to_piece(tok.eos_id)
    assert info["pad_token_id"] == tok.pad_id and info["pad_token"] == tok.id_to_piece(tok.pad_id)
    assert info["bos_token_id"] == tok.bos_id
    assert info["vocab_size"] == tok.vocab_size and info["tokenizer_class"] == tok.kind
    assert info["model_max_length"] == client.post("/tokenize", json={"prompt": "a"}).json()["max_model_len"]
    assert info["chat_template"] is None  # the tiny artifact carries none


def test_a_prompt_of_token_ids_generates_as_its_text_does(client: TestClient, artifact: Any) -> None:
    ids = artifact.tokenizer.encode("Once upon a time")
    request = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    by_text = client.post("/v1/completions", json={**request, "prompt": "Once upon a time"}).json()
    by_ids = client.post("/v1/completions", json={**request, "prompt": ids}).json()
    nested = client.post("/v1/completions", json={**request, "prompt": [ids, ids[:4]]}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    assert [c["index"] for c in nested["choices"]] == [0, 1]
    assert nested["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert nested["usage"]["prompt_tokens"] == len(ids) + 4
    echoed = client.post("/v1/completions", json={**request, "prompt": ids, "echo": True}).json()
    assert echoed["choices"][0]["text"] == "Once upon a time" + by_text["choices"][0]["text"]


def test_special_ids_are_prompt_tokens_too(client: TestClient, artifact: Any) -> None:
    """lm-eval puts the end-of-text id first in a rolling window's context."""
    ids = [artifact.tokenizer.eos_id, *artifact.tokenizer.encode("abc")]
    r = client.post("/v1/completions", json={"prompt": [ids], "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("prompt, param", [
    ([65, 100000], "prompt.1"),
    ([[65, 66], [67, -3]], "prompt.1.1"),
    ([[65, 66], []], "prompt.1"),
    ([65, "b"], "prompt"),
    ([65, True], "prompt"),
    ([[65], "text"], "prompt"),
    ([65, 66.0], "prompt"),
])
def test_token_id_prompts_refuse_bad_ids_by_name(client: TestClient, prompt: Any, param: str) -> None:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code // 100 == 4, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if param == "prompt":  # of no accepted shape: one message naming the item that breaks it
        assert "a list of token ids" in error["message"] and "item" in error["message"], error


def test_token_id_prompts_obey_the_input_limit_and_truncation(client: TestClient) -> None:
    ids = [70] * 80  # the input limit is 64
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
    assert r.status_code // 100 == 4 and r.json()["error"]["param"] == "prompt", r.text
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10


def test_special_tokens_spelled_in_a_vllm_prompt_are_their_ids(client: TestClient, artifact: Any) -> None:
    """lm-eval's remote tokenizer finds the end-of-text id as the tokens of /tokenizer_info's eos_token."""
    tok = artifact.tokenizer
    info = client.get("/tokenizer_info").json()
    eos = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [tok.eos_id]
    mixed = client.post("/tokenize", json={"prompt": f"a{info['eos_token']}b{info['pad_token']}",
                                           "add_special_tokens": False}).json()
    assert mixed["tokens"] == [*tok.encode("a"), tok.eos_id, *tok.encode("b"), tok.pad_id]
    # TGI's /tokenize and prompts keep text as text
    assert [p["id"] for p in client.post("/tokenize", json={"inputs": info["eos_token"]}).json()] \
        == tok.encode(info["eos_token"])


def test_add_special_tokens_puts_the_beginning_of_text_id_first_when_there_is_one(client: TestClient) -> None:
    class WithBos:
        bos_id = 7

    class WithoutBos:
        bos_id = None

    assert with_bos([65, 66], WithBos(), True) == [7, 65, 66]
    assert with_bos([65, 66], WithBos(), False) == [65, 66]
    assert with_bos([65, 66], WithoutBos(), True) == [65, 66]
    # the byte tokenizer has none: the flag changes nothing, on either body
    assert client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": True}).json()["tokens"] \
        == client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).json()["tokens"]


def test_tokenizer_routes_name_this_servers_model_or_are_not_found(client: TestClient) -> None:
    model = client.get("/v1/models").json()["data"][0]["id"]
    assert client.post("/tokenize", json={"prompt": "a", "model": model}).status_code == 200
    assert client.post("/detokenize", json={"tokens": [70], "model": model}).status_code == 200
    for route, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [70]})):
        r = client.post(route, json={**body, "model": "gpt-4"})
        assert r.status_code == 404 and r.json()["error_type"] == "model_not_found", r.text
