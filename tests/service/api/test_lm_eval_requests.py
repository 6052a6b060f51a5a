"""The exact requests lm-evaluation-harness 0.4.13 sends with `--model local-completions` and the server's own
tokenizer (lm_eval/utils.py RemoteTokenizer and check_remote_tokenizer_support, lm_eval/models/
openai_completions.py _create_payload and parse_logprobs), answered as lm-eval reads them; the scores equal the
model's own log-likelihoods computed in process."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from tests.service.helpers import running_app, stepped_logprobs

SEED = 1234  # lm-eval's default


@pytest.fixture(scope="module")
def client(artifact: Any) -> Any:
    with running_app(artifact, max_new_tokens=32, max_input_tokens=512, max_client_batch_size=8) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(client: TestClient) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


def encode(client: TestClient, text: str) -> list[int]:
    """RemoteTokenizer.encode."""
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    r.raise_for_status()
    tokens = r.json().get("tokens")
    assert isinstance(tokens, list)
    return tokens


def loglikelihood_payload(model: str, prompts: list[list[int]]) -> dict[str, Any]:
    """_create_payload(generate=False)."""
    return {"model": model, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": SEED,
            "echo": True}


def parse_logprobs(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs, as lm-eval reads the answer."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens, strict=False):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs, strict=False))
        res.append((logprobs, is_greedy))
    return res


@pytest.fixture(scope="module")
def causal(client: TestClient) -> bool:
    """Whether the server reads prompts causally (REFORMER_PREFILL=auto: on a CPU with the C kernels)."""
    return bool(client.get("/info").json()["batching"]["prefill"] == "causal")


@torch.no_grad()
def in_process(artifact: Any, context: list[int], continuation: list[int], causal: bool) -> tuple[float, bool]:
    """The continuation's log-likelihood and whether it is greedy, from the model itself, read as the server
    reads a prompt: one decode step per token under the causal prefill, else the one-piece forward."""
    ids = torch.tensor([context + continuation])  # (1, T)
    if causal:
        logp = stepped_logprobs(artifact.model, ids[0, :-1].tolist())  # (T-1, vocab)
    else:
        logp = torch.log_softmax(artifact.model(ids[:, :-1]).logits.float(), dim=-1)[0]  # (T-1, vocab)
    rows = torch.arange(len(context) - 1, ids.shape[1] - 1)
    targets = ids[0, len(context):]
    return float(logp[rows, targets].sum()), bool((logp[rows].argmax(-1) == targets).all())


def test_remote_tokenizer_support_is_detected(client: TestClient) -> None:
    """check_remote_tokenizer_support: /tokenizer_info has eos_token, /tokenize answers tokens."""
    info = client.get("/tokenizer_info")
    assert info.status_code == 200 and isinstance(info.json(), dict) and "eos_token" in info.json()
    assert isinstance(encode(client, "test"), list)


def test_the_end_of_text_id_is_found_as_lm_eval_finds_it(client: TestClient, artifact: Any) -> None:
    """RemoteTokenizer.eos_token_id is encode(eos_token)[0]; the prefix token of every rolling window."""
    info = client.get("/tokenizer_info").json()
    assert encode(client, info["eos_token"])[0] == artifact.tokenizer.eos_id
    if info.get("bos_token") is None:
        assert info["bos_token_id"] is None  # prefix_token_id falls back to the end-of-text id


def test_decode_round_trips(client: TestClient) -> None:
    """RemoteTokenizer.decode: POST /detokenize {"tokens"} -> {"prompt"}."""
    text = "It was the best of times, it was the worst of times."
    r = client.post("/detokenize", json={"tokens": encode(client, text)})
    assert r.status_code == 200 and r.json()["prompt"] == text


def test_loglikelihood_requests_score_as_the_model_does(client: TestClient, artifact: Any, model_name: str,
                                                        causal: bool) -> None:
    """Two (context, continuation) pairs in one batched request, token ids in, echo logprobs out."""
    pairs = [("The quick brown fox", " jumps over the lazy dog"), ("Once upon a", " time")]
    prompts, ctxlens = [], []
    for context, continuation in pairs:
        whole = encode(client, context + continuation)
        ctx = encode(client, context)
        prompts.append(whole)
        ctxlens.append(len(ctx))
    r = client.post("/v1/completions", json=loglikelihood_payload(model_name, prompts))
    assert r.status_code == 200, r.text
    parsed = parse_logprobs(r.json(), ctxlens)
    for (served, greedy), whole, ctxlen in zip(parsed, prompts, ctxlens, strict=True):
        expected, expected_greedy = in_process(artifact, whole[:ctxlen], whole[ctxlen:], causal)
        assert served == pytest.approx(expected, rel=1e-4, abs=1e-3)
        assert greedy == expected_greedy


def test_a_rolling_window_is_scored_after_the_end_of_text_prefix(client: TestClient, artifact: Any,
                                                                 model_name: str, causal: bool) -> None:
    """loglikelihood_rolling: the first window is [eos] + the document, context length 1."""
    doc = encode(client, "Four score and seven years ago our fathers brought forth on this continent")
    prefix = encode(client, client.get("/tokenizer_info").json()["eos_token"])[0]
    r = client.post("/v1/completions", json=loglikelihood_payload(model_name, [[prefix, *doc]]))
    assert r.status_code == 200, r.text
    [(served, _)] = parse_logprobs(r.json(), [1])
    expected, _ = in_process(artifact, [prefix], doc, causal)
    assert served == pytest.approx(expected, rel=1e-4, abs=1e-3)
    assert r.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None  # the first prompt token has none


def test_generate_until_requests_answer_text(client: TestClient, artifact: Any, model_name: str) -> None:
    """_create_payload(generate=True) with lm-eval's defaults: ids in, greedy, stop at the `until` strings."""
    context = encode(client, "In the beginning")
    info = client.get("/tokenizer_info").json()
    payload = {"prompt": [context], "model": model_name, "max_tokens": 12, "temperature": 0,
               "stop": ["\n\n", info["eos_token"]], "seed": SEED}
    r = client.post("/v1/completions", json=payload)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0]
    plain = client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 12, "temperature": 0,
                                                 "stop": ["\n\n"]}).json()
    assert choices[0]["text"] == plain["choices"][0]["text"]
