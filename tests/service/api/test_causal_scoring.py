"""Prompt scoring under the causal prefill (REFORMER_PREFILL=causal): a scored prompt (OpenAI echo with logprobs,
max_tokens 0, TGI's decoder_input_details) is read by the extend with every token's logits
(service/engine/runner.py `extend_slices(score=k)`), so its scores are those of one decode step per token: the
semantics generation uses. The reference here is a Decoder stepping the prompt one token at a time
(tests/service/helpers.py `stepped_logprobs`)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from service.api.protocol.logprobs import token_key
from service.prefix_cache.keys import KEY_BLOCK_TOKENS
from tests.service.helpers import running_app, stepped_logprobs

# byte tokenizer: one token per character; long enough to cross several LSH chunks (where the one-piece
# forward's windows see later tokens) and two 256-token block boundaries
DOC = ("The harbour master kept a ledger of every ship that came in, its cargo, its crew and the weather. "
       "In the valley the river turned twice before it reached the mill. ") * 4
SETTINGS: dict[str, Any] = dict(prefill="causal", max_new_tokens=8, max_input_tokens=1024, prefix_cache=False)


@pytest.fixture(scope="module")
def causal(artifact: Any) -> Iterator[TestClient]:
    with running_app(artifact, **SETTINGS) as c:
        assert c.get("/info").json()["batching"]["prefill"] == "causal"
        yield c


def echo(client: TestClient, prompt: Any, logprobs: int = 2) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": logprobs, "max_tokens": 0})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()["choices"][0]["logprobs"]
    return out


def test_echo_scores_are_the_decode_steps(causal: TestClient, artifact: Any) -> None:
    """Every prompt token's logprob and alternatives are those of the step-by-step logits, bit for bit."""
    got = echo(causal, DOC, logprobs=3)
    ids = artifact.tokenizer.encode(DOC)
    want = stepped_logprobs(artifact.model, ids)
    assert len(got["tokens"]) == len(ids) and got["token_logprobs"][0] is None
    chosen = want[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    assert got["token_logprobs"][1:] == chosen.tolist()  # equal floats
    for t, top in enumerate(got["top_logprobs"][1:]):
        values, best = want[t].topk(3)
        for i, v in zip(best.tolist(), values.tolist(), strict=True):
            assert top[token_key(artifact.tokenizer, i)] == v


def test_the_scores_are_not_the_one_piece_forwards(causal: TestClient, artifact: Any) -> None:
    """The comparison above tells the semantics apart: a one-piece server scores DOC otherwise."""
    with running_app(artifact, **{**SETTINGS, "prefill": "one-piece"}) as one_piece:
        other = echo(one_piece, DOC)
    assert echo(causal, DOC)["token_logprobs"] != other["token_logprobs"]


def test_a_scored_token_has_the_logprob_generation_gives_it(causal: TestClient, artifact: Any) -> None:
    """A greedy completion's first token: its logprob = the echo score of that token appended to the prompt."""
    ids = artifact.tokenizer.encode(DOC)
    r = causal.post("/generate", json={"inputs": DOC, "parameters": {"max_new_tokens": 1, "details": True}})
    assert r.status_code == 200, r.text
    first = r.json()["details"]["tokens"][0]
    scored = echo(causal, [*ids, first["id"]], logprobs=1)
    assert scored["token_logprobs"][-1] == first["logprob"]


def test_scored_alone_or_among_others_gives_the_same_numbers(causal: TestClient) -> None:
    alone = echo(causal, DOC)
    others = [{"prompt": DOC[: 40 + 13 * i], "max_tokens": 6, "temperature": 0} for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        busy = [pool.submit(causal.post, "/v1/completions", json=body) for body in others]
        together = [pool.submit(echo, causal, DOC) for _ in range(2)]
        assert all(f.result().status_code == 200 for f in busy)
        assert all(f.result() == alone for f in together)


def test_tgi_decoder_input_details(causal: TestClient, artifact: Any) -> None:
    parameters = {"max_new_tokens": 3, "details": True, "decoder_input_details": True}
    r = causal.post("/generate", json={"inputs": DOC, "parameters": parameters})
    assert r.status_code == 200, r.text
    prefill = r.json()["details"]["prefill"]
    ids = artifact.tokenizer.encode(DOC)
    want = stepped_logprobs(artifact.model, ids)
    assert [t["id"] for t in prefill] == ids and prefill[0]["logprob"] is None
    chosen = want[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    assert [t["logprob"] for t in prefill[1:]] == chosen.tolist()
    # its generated tokens are those of the same prompt unscored
    plain = causal.post("/generate", json={"inputs": DOC, "parameters": {"max_new_tokens": 3, "details": True}})
    assert [t["id"] for t in r.json()["details"]["tokens"]] == [t["id"] for t in plain.json()["details"]["tokens"]]


def test_a_one_token_prompt_is_scored_with_nothing(causal: TestClient) -> None:
    got = echo(causal, "T")
    assert got["tokens"] == ["T"] and got["token_logprobs"] == [None]


def test_with_the_prefix_cache(artifact: Any) -> None:
    """A scored prompt's state is kept like an unscored prompt's (a later prompt sharing it continues from its
    last boundary), and a scored prompt is read from position 0 whatever is kept: its scores are the cold ones."""
    ids = artifact.tokenizer.encode(DOC + " Why?")
    want = stepped_logprobs(artifact.model, ids)
    chosen = want[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()
    with running_app(artifact, **{**SETTINGS, "prefix_cache": True, "prefix_cache_min_tokens": 16}) as on:
        first = echo(on, DOC + " Why?")
        later = on.post("/generate", json={"inputs": DOC + " Where?", "parameters": {"max_new_tokens": 2,
                                                                                   "details": True}})
        again = echo(on, DOC + " Why?")
    assert later.status_code == 200, later.text
    assert later.json()["details"]["cached_tokens"] == (len(DOC) // KEY_BLOCK_TOKENS) * KEY_BLOCK_TOKENS
    assert first["token_logprobs"][1:] == chosen and again == first
