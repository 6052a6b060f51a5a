"""Every route's happy path and response shape, in process (the subprocess tests cover real HTTP)."""

from __future__ import annotations

import base64
import struct
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from tests.service.helpers import running_app, sse_events

TIMING_HEADERS = ("x-queue-time", "x-inference-time", "x-total-time", "x-prompt-tokens", "x-generated-tokens")


@pytest.fixture(scope="module")
def client(artifact: Any) -> Any:
    with running_app(artifact, max_new_tokens=64, max_input_tokens=256) as c:
        yield c


def test_generate_returns_text_details_and_timing_headers(client: TestClient) -> None:
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5, "details": True,
                                                                        "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["details"]["finish_reason"] == "length"
    assert body["details"]["generated_tokens"] == 5
    assert body["details"]["prompt_tokens"] == 5
    assert len(body["details"]["tokens"]) == 5
    assert isinstance(body["details"]["seed"], int)
    for header in TIMING_HEADERS:
        assert header in r.headers
    assert r.headers["x-prompt-tokens"] == "5" and r.headers["x-generated-tokens"] == "5"
    assert r.headers["x-request-id"]


def test_generate_is_deterministic_with_a_seed(client: TestClient) -> None:
    request = {"inputs": "Once upon", "parameters": {"max_new_tokens": 8, "do_sample": True, "seed": 7,
                                                      "temperature": 0.9, "top_k": 50, "ignore_eos": True}}
    first = client.post("/generate", json=request).json()
    second = client.post("/generate", json=request).json()
    assert first == second


def test_generate_return_full_text_prepends_the_prompt(client: TestClient) -> None:
    r = client.post("/generate", json={"inputs": "abc", "parameters": {"max_new_tokens": 2,
                                                                      "return_full_text": True}})
    assert r.json()["generated_text"].startswith("abc")


def test_generate_stream_sends_one_event_per_token_and_details_last(client: TestClient) -> None:
    plain = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4,
                                                                             "ignore_eos": True}}).json()
    r = client.post("/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4,
                                                                                "ignore_eos": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert [e["index"] for e in events] == [0, 1, 2, 3]
    assert all(e["details"] is None for e in events[:-1])
    assert events[-1]["details"]["finish_reason"] == "length"
    assert events[-1]["generated_text"] == plain["generated_text"]
    assert "".join(e["token"]["text"] for e in events) == plain["generated_text"]


def test_embed_single_and_list(client: TestClient) -> None:
    one = client.post("/embed", json={"inputs": "some text"})
    assert one.status_code == 200
    vectors = one.json()
    assert len(vectors) == 1 and len(vectors[0]) == 64
    assert abs(sum(v * v for v in vectors[0]) - 1.0) < 1e-5  # normalised by default
    many = client.post("/embed", json={"inputs": ["a", "some text", "b" * 40], "normalize": False,
                                       "pooling": "last"})
    assert many.status_code == 200 and len(many.json()) == 3
    assert many.headers["x-prompt-tokens"] == str(1 + 9 + 40)


def test_v1_completions_and_stream_end_with_done(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "logprobs": 1, "ignore_eos": True,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 3
    s = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "stream": True, "ignore_eos": True,
                                             "temperature": 0})
    events = sse_events(s.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == body["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_v1_completions_several_prompts(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": ["a", "bb"], "max_tokens": 2, "ignore_eos": True})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert r.json()["usage"]["completion_tokens"] == 4


def test_v1_embeddings_float_and_base64_agree(client: TestClient) -> None:
    floats = client.post("/v1/embeddings", json={"input": ["hello", "world"]}).json()
    assert floats["object"] == "list" and len(floats["data"]) == 2
    assert floats["usage"]["prompt_tokens"] == 10
    packed = client.post("/v1/embeddings", json={"input": ["hello", "world"], "encoding_format": "base64"}).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert decoded == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)


def test_v1_models_lists_the_served_model(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == client.get("/info").json()["model_id"]


def test_tokenize_gives_ids_and_character_offsets(client: TestClient) -> None:
    pieces = client.post("/tokenize", json={"inputs": "hé"}).json()
    assert [p["start"] for p in pieces] == [0, 1, 1]
    assert [p["id"] for p in pieces] == [ord("h") + 2, 0xC3 + 2, 0xA9 + 2]


def test_probes_info_metrics_and_docs(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}
    info = client.get("/info").json()
    assert info["backend"] == "torch" and info["decode_backend"] == "c-fused"
    assert info["device"] == "cpu" and info["limits"]["max_input_tokens"] == 256
    assert "api_key" not in info["settings"]
    assert client.get("/metrics").text.startswith("# HELP")
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/generate", "/generate_stream", "/embed", "/v1/completions", "/v1/embeddings", "/v1/models",
                 "/tokenize", "/health", "/ready", "/info", "/metrics"):
        assert path in paths


def test_only_streaming_routes_ask_the_engine_for_token_by_token_delivery(client: TestClient,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    engine = client.app.state.service.engine  # type: ignore[attr-defined]
    asked: list[bool] = []
    real = engine.generate

    def generate(spec: Any, request_id: Any = None, reservation: Any = None, stream: bool = True) -> Any:
        asked.append(stream)
        return real(spec, request_id, reservation, stream)

    monkeypatch.setattr(engine, "generate", generate)
    params = {"max_new_tokens": 3}
    assert client.post("/generate", json={"inputs": "Hi", "parameters": params}).status_code == 200
    assert client.post("/generate_stream", json={"inputs": "Hi", "parameters": params}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3,
                                                "stream": True}).status_code == 200
    assert asked == [False, True, False, True]


def test_info_says_whether_decoding_attends_through_the_cpu_kernel(client: TestClient, artifact: Any) -> None:
    batching = client.get("/info").json()["batching"]
    assert batching["cpu_window_kernel"] is True and batching["cpu_step_kernel"] is True
    assert batching["cpu_chunk_kernel"] is True
    request = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12, "ignore_eos": True}}
    fused = client.post("/generate", json=request).json()["generated_text"]
    info = client.get("/info").json()
    assert info["runs"] == {"decode_step": "c-fused", "decode_attention": "c", "prefill_attention": "c",
                            "decode_weights": "float32"}
    assert info["decode_backend"] == "c-fused"
    assert info["kernels"]["mode"] == "auto" and info["kernels"]["loaded"] is True
    assert info["kernels"]["source"].startswith(("installed:", "first-use build"))
    metrics = client.get("/metrics").text
    assert ('reformer_backend_info{decode_attention="c",decode_step="c-fused",decode_weights="float32",device="cpu",'
            in metrics)
    with running_app(artifact, max_new_tokens=64, max_input_tokens=256, cpu_kernels="off") as plain:
        batching = plain.get("/info").json()["batching"]
        assert batching["cpu_window_kernel"] is False and batching["cpu_step_kernel"] is False
        assert batching["cpu_chunk_kernel"] is False  # the forward's chunk windows too
        info = plain.get("/info").json()
        assert info["runs"]["decode_step"] == "torch" and info["runs"]["prefill_attention"] == "torch-flash"
        assert info["kernels"] == {"mode": "off", "loaded": False, "source": "off",
                                   "reason": "REFORMER_CPU_KERNELS=off", "path": None}
        assert 'decode_step="torch"' in plain.get("/metrics").text
        # greedy: the same tokens through either path
        assert plain.post("/generate", json=request).json()["generated_text"] == fused


def test_a_float16_decode_cache_is_reported_and_decodes_near_float32(client: TestClient, artifact: Any) -> None:
    request = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12, "ignore_eos": True, "details": True}}
    full = client.post("/generate", json=request).json()["details"]["tokens"]
    assert client.get("/info").json()["batching"]["kv_cache_dtype"] == "float32"
    with running_app(artifact, max_new_tokens=64, max_input_tokens=256, kv_cache_dtype="float16") as half:
        batching = half.get("/info").json()["batching"]
        assert batching["kv_cache_dtype"] == "float16" and batching["cpu_window_kernel"] is True
        r = half.post("/generate", json=request)
        assert r.status_code == 200, r.text
        tokens = r.json()["details"]["tokens"]
        # the setting reaches the pools the steps read (their values are checked in tests/model/
        # test_kv_cache_dtype.py: this tiny artifact's attention is too flat for a broken half cache to change
        # its tokens, as a mutation that zeroed every step's float16 writes showed)
        cache = half.app.state.service.engine.runner.cache  # type: ignore[attr-defined]
        assert all(k.dtype == torch.float16 for k in cache.keys + cache.values)
    assert len(tokens) == 12
    # the first token comes from the prefill, which never reads the cache; the rest agree until a near tie
    assert tokens[0] == full[0]
    for a, b in zip(full, tokens, strict=True):
        if a["id"] != b["id"]:
            break
        assert abs(a["logprob"] - b["logprob"]) <= 1e-2  # float16 keeps 11 significant bits


def test_the_decode_weights_setting_reaches_the_step_info_and_metrics(client: TestClient, artifact: Any) -> None:
    assert client.get("/info").json()["runs"]["decode_weights"] == "float32"
    request = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    with running_app(artifact, max_new_tokens=64, max_input_tokens=256, decode_weights="int8") as small:
        info = small.get("/info").json()
        assert info["runs"]["decode_weights"] == "int8" and info["runs"]["decode_step"] == "c-fused"
        assert 'decode_weights="int8"' in small.get("/metrics").text
        linears = small.app.state.service.engine.runner.decoder.backends.linears  # type: ignore[attr-defined]
        assert linears.weights == "int8"
        r = small.post("/generate", json=request)
        assert r.status_code == 200, r.text
        # the step read int8 packings (model/kernels/weights.py), not float32 ones
        assert {p.weight.dtype for p in linears._packed.values()} == {torch.uint8}


def test_the_prefill_budget_setting_reaches_the_engine_and_info(client: TestClient, artifact: Any) -> None:
    assert client.get("/info").json()["batching"]["prefill_budget_ms"] == 100.0
    with running_app(artifact, max_new_tokens=8, max_input_tokens=256, prefill_budget_ms=25.0) as tight:
        assert tight.get("/info").json()["batching"]["prefill_budget_ms"] == 25.0
        assert tight.app.state.service.engine.config.prefill_budget_ms == 25.0
