"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from export import save_artifact
from model import ByteTokenizer, ReformerConfig, ReformerLM


def tiny_config(**overrides: object) -> ReformerConfig:
    """A few-thousand-parameter byte-level model with both attention kinds, chunks of 8 and fixed buckets
    (fixed buckets make the hash rotations constants, as ONNX export needs)."""
    base: dict[str, object] = dict(
        vocab_size=258, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        attn_layers=["local", "lsh"], feed_forward_size=64, lsh_attn_chunk_length=8, local_attn_chunk_length=8,
        num_hashes=2, num_buckets=4, axial_pos_shape=(32, 64), axial_pos_embds_dim=(16, 16),
        max_position_embeddings=2048, hash_seed=0, is_decoder=True, eos_token_id=1, pad_token_id=0,
    )
    base.update(overrides)
    return ReformerConfig(**base)  # type: ignore[arg-type]


def tiny_model(seed: int = 0, **overrides: object) -> ReformerLM:
    torch.manual_seed(seed)
    return ReformerLM(tiny_config(**overrides)).eval()


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved artifact (no ONNX graph, for speed) of a tiny random model; read-only for tests."""
    out = tmp_path_factory.mktemp("tiny_artifact") / "artifact"
    save_artifact(tiny_model(), out, tokenizer=ByteTokenizer(),
                  provenance={"note": "random weights for tests"}, onnx=False)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `pytest -n 2 --dist loadgroup` (what `make test` runs), keep each test module on one worker so
    its module-scoped fixtures (servers, exported graphs) are built once, not once per worker.

    Schemathesis gives every API operation of a `@schema.parametrize()` test the same node id (pytest 9), and
    pytest-xdist runs one item per node id: under xdist only `POST /generate` was fuzzed (seen by logging
    each case's operation). Under xdist those items are deselected; `make test` runs
    tests/service/api/test_fuzz.py again on its own, without xdist, where every operation runs."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        fuzzed = [item for item in items if getattr(item, "operation_label", None) is not None]
        if fuzzed:
            config.hook.pytest_deselected(items=fuzzed)
            items[:] = [item for item in items if getattr(item, "operation_label", None) is None]
    for item in items:
        if not any(m.name == "xdist_group" for m in item.iter_markers()):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))


@pytest.fixture(autouse=True)
def _denormals_as_torch_leaves_them() -> Iterator[None]:
    """A test that runs a benchmark's or the server's main applies the process settings, which flush denormals
    for the rest of the process (model/decoding/runtime.py); the next test on the same worker gets torch's
    default back (a float as small as 5e-324 otherwise reads as 0)."""
    yield
    torch.set_flush_denormal(False)
