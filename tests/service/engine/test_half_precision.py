"""The service with REFORMER_DTYPE=bfloat16 (the CUDA default), run on CPU, against the same artifact in fp32.

Tolerances: bf16 keeps 8 significant bits; tests/model/test_half_precision.py holds a bf16 model's logits to
3% of the logit scale (measured about 0.5% here, where bf16 also rounds the artifact's fp32 weights).
- /embed returns unit vectors (normalize: true): each component within 0.03, 3% of their scale 1.
- /generate's token logprobs are logit minus log-sum-exp, so each moves by at most twice the logit error:
  this random tiny artifact's |logits| stay below 1, giving 2 x 0.03 x 1 = 0.06.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

TEXTS = ["The quick brown fox jumps over the lazy dog, again and again.", "short", "x" * 300]
EMBED_TOL = 0.03
LOGPROB_TOL = 0.06


@pytest.fixture(scope="module")
def servers(server_factory: Any) -> dict[str, Any]:
    return {dtype: server_factory(backend="torch", device="cpu", dtype=dtype) for dtype in ("float32", "bfloat16")}


def test_info_reports_the_dtype(servers: dict[str, Any]) -> None:
    for dtype, server in servers.items():
        info = httpx.get(server.url + "/info", timeout=30).json()
        assert dtype in str(info), info


def test_embed_in_bf16_matches_fp32(servers: dict[str, Any]) -> None:
    got = {}
    for dtype, server in servers.items():
        r = httpx.post(server.url + "/embed", json={"inputs": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text  # was a 500: a dtype mismatch in the fused LSH kernel's self rows
        got[dtype] = r.json()
    for a, b in zip(got["float32"], got["bfloat16"], strict=True):
        assert len(a) == len(b)
        assert max(abs(x - y) for x, y in zip(a, b)) <= EMBED_TOL


def test_generate_in_bf16_matches_fp32(servers: dict[str, Any]) -> None:
    body = {"inputs": TEXTS[0], "parameters": {"max_new_tokens": 8, "details": True, "ignore_eos": True}}
    tokens = {}
    for dtype, server in servers.items():
        r = httpx.post(server.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        tokens[dtype] = r.json()["details"]["tokens"]
        assert len(tokens[dtype]) == 8
    compared = 0
    # greedy choices agree until a near tie (logits within the rounding) picks another token; from there the
    # two continuations differ and are not compared
    for a, b in zip(tokens["float32"], tokens["bfloat16"], strict=True):
        if a["id"] != b["id"]:
            break
        assert abs(a["logprob"] - b["logprob"]) <= LOGPROB_TOL
        compared += 1
    assert compared >= 1, (tokens["float32"][0], tokens["bfloat16"][0])
