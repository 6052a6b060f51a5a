"""Streamed text joins to the non-streamed text for any tokenizer (bytes, SentencePiece), on multi-byte text;
stop sequences that span token boundaries end a generation."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from export.artifact import load_artifact, save_artifact
from model import ByteTokenizer
from model.tokenizer import Tokenizer
from service.text.detokenize import TextStream
from tests.conftest import tiny_model
from tests.model.tokenizers.helpers import SAMPLE, hf_chat_tokenizer, sentencepiece_tokenizer
from tests.service.helpers import running_app, sse_events

PROMPT = "日本語 naïve café 🤖 мир"


@pytest.fixture(scope="module")
def sp_artifact(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tok = sentencepiece_tokenizer()
    out = tmp_path_factory.mktemp("sp_service") / "artifact"
    save_artifact(tiny_model(seed=3, vocab_size=tok.vocab_size, eos_token_id=tok.eos_id), out, tokenizer=tok,
                  onnx=False)
    return load_artifact(out)


@pytest.mark.parametrize("tok", [ByteTokenizer(), sentencepiece_tokenizer(), sentencepiece_tokenizer(320, True)],
                         ids=["bytes", "sentencepiece", "sentencepiece-bytes"])
def test_a_text_stream_joins_to_the_decode_and_finds_stops_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(SAMPLE)
    stream = TextStream(tok)
    parts = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(parts) == tok.decode(ids)
    stop = "ve ré"  # several tokens in every one of these tokenizers
    assert len(tok.encode(stop)) > 1
    stream = TextStream(tok, [stop])
    text, stopped_at = "", None
    for n, i in enumerate(ids):
        piece = stream.push(i)
        text += piece
        if stream.stopped(piece):
            stopped_at = n
            break
    assert stopped_at is not None and stop in text
    assert stop not in tok.decode(ids[:stopped_at])  # it is the token that completes it which stops


def _stream_matches_plain(client: TestClient, tok: Tokenizer, params: dict[str, Any]) -> str:
    plain = client.post("/generate", json={"inputs": PROMPT, "parameters": {**params, "details": True}})
    assert plain.status_code == 200, plain.text
    body = plain.json()
    r = client.post("/generate_stream", json={"inputs": PROMPT, "parameters": params})
    events = sse_events(r.text)
    streamed = "".join(e["token"]["text"] for e in events)
    assert streamed == body["generated_text"] == events[-1]["generated_text"]
    ids = [t["id"] for t in body["details"]["tokens"]]
    assert len(ids) == params["max_new_tokens"]  # counted in tokens, whatever their text
    assert body["generated_text"] == tok.decode(ids)
    v1 = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": params["max_new_tokens"],
                                              "stream": True, "ignore_eos": True, "temperature": 0})
    chunks = sse_events(v1.text)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["generated_text"]
    return str(body["generated_text"])


def test_bytes_stream_as_they_decode(artifact: Any) -> None:
    with running_app(artifact) as client:
        text = _stream_matches_plain(client, artifact.tokenizer, {"max_new_tokens": 48, "ignore_eos": True})
    assert text  # random bytes: broken sequences decode as U+FFFD, in the stream as in the whole


def test_sentencepiece_streams_as_it_decodes(sp_artifact: Any) -> None:
    assert sp_artifact.tokenizer.kind == "sentencepiece"
    with running_app(sp_artifact) as client:
        text = _stream_matches_plain(client, sp_artifact.tokenizer, {"max_new_tokens": 40, "ignore_eos": True})
        tokens = client.post("/tokenize", json={"inputs": PROMPT, "add_special_tokens": False}).json()
    assert " " in text  # word-boundary pieces kept their spaces
    assert [t["id"] for t in tokens] == sp_artifact.tokenizer.encode(PROMPT)


def test_a_stop_sequence_spanning_sentencepiece_pieces_ends_the_generation(sp_artifact: Any) -> None:
    with running_app(sp_artifact) as client:
        free = client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 40,
                                                                               "ignore_eos": True}}).json()
        text = free["generated_text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        stopped = client.post("/generate", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": 40, "ignore_eos": True, "stop": [stop], "details": True}}).json()
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert stopped["generated_text"].endswith(stop) or stop in stopped["generated_text"]
    assert text.startswith(stopped["generated_text"])


def test_tgi_stops_only_where_the_text_ends_with_the_stop_openai_anywhere_in_the_token() -> None:
    """One token of several characters (`ab` + newline): TGI's stop "b" is not at the end of the text, so it
    does not stop there; OpenAI's (and vLLM's) stop strings match anywhere in the token's text."""
    tok = hf_chat_tokenizer()
    word = tok.encode("ab\n")
    assert len(word) == 1
    for at_end, stops in ((True, False), (False, True)):
        stream = TextStream(tok, ["b"], at_end=at_end)
        assert stream.stopped(stream.push(word[0])) is stops
    tgi = TextStream(tok, ["b\n"], at_end=True)
    assert tgi.stopped(tgi.push(word[0]))  # at the end: it does
