"""One semantics across backends: for random small configs (seeded, so every run sees the same cases) and
batches of mixed lengths padded on the left, the right or both, every real token of every row gets the
result of that row alone, in the eager torch forward, in the static forward the ONNX graph is traced from,
and in onnxruntime on an exported graph; hidden states and logits, lengths up to 4K (16K marked slow)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from export import onnx_export as ox
from export import onnx_ties as ox_ties
from export.onnx_graph import static_forward
from model import ReformerConfig, ReformerLM
from model.batch import InvalidAttentionMask
from tests.model.helpers import tiny_config

ALONE_TOL = 1e-5  # eager batched vs eager alone: the same kernels, so float rounding only
BACKEND_TOL = ox.PARITY_TOLERANCE  # static forward / onnxruntime vs eager


def random_config(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    heads, head_size = rng.choice([1, 2]), rng.choice([4, 8])
    hidden = rng.choice([16, 32])
    causal = rng.random() < 0.7
    after = (lambda: 0) if causal else (lambda: rng.choice([0, 1]))  # a causal model looks back only
    return dict(
        hidden_size=hidden, num_attention_heads=heads, attention_head_size=head_size,
        attn_layers=rng.choice([["local", "lsh"], ["lsh", "local", "lsh"], ["lsh"], ["local", "local", "lsh"]]),
        feed_forward_size=2 * hidden, lsh_attn_chunk_length=rng.choice([4, 8]),
        local_attn_chunk_length=rng.choice([4, 8, 16]), num_hashes=rng.choice([1, 2, 3]),
        num_buckets=rng.choice([2, 4, 8]), is_decoder=causal,
        lsh_num_chunks_before=rng.choice([0, 1]), lsh_num_chunks_after=after(),
        local_num_chunks_before=rng.choice([0, 1]), local_num_chunks_after=after(),
        axial_pos_embds_dim=(hidden // 2, hidden // 2), hash_seed=seed,
    )


def random_batch(cfg: ReformerConfig, rng: random.Random, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """3-4 rows of mixed lengths, each padded on the left, the right or both."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    lengths = [rng.randint(1, longest)] + [rng.randint(1, max(1, longest // 3)) for _ in range(rng.randint(2, 3))]
    lefts = [rng.choice([0, rng.randint(0, 20)]) for _ in lengths]
    total = max(n + left for n, left in zip(lengths, lefts, strict=True)) + rng.randint(0, 5)
    ids = torch.randint(2, cfg.vocab_size, (len(lengths), total), generator=g)
    mask = torch.zeros_like(ids)
    for i, (n, left) in enumerate(zip(lengths, lefts, strict=True)):
        mask[i, left : left + n] = 1
    return ids, mask


def row_alone(lm: ReformerLM, ids: torch.Tensor, mask: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    real = mask[i].bool()
    out = lm(ids[i][real][None])
    return out.logits[0], out.hidden_states[0]


def assert_rows_match(logits: Any, hidden: Any, lm: ReformerLM, ids: torch.Tensor, mask: torch.Tensor,
                      tol: float) -> None:
    logits, hidden = torch.as_tensor(logits), torch.as_tensor(hidden)
    for i in range(ids.shape[0]):
        real = mask[i].bool()
        alone_logits, alone_hidden = row_alone(lm, ids, mask, i)
        assert (logits[i][real] - alone_logits).abs().max().item() <= tol, (i, int(real.sum()))
        assert (hidden[i][real] - alone_hidden).abs().max().item() <= tol, (i, int(real.sum()))


@pytest.mark.parametrize("seed", range(12))
def test_random_configs_batched_static_and_alone_agree(seed: int) -> None:
    torch.manual_seed(seed)
    lm = ReformerLM(tiny_config(**random_config(seed))).eval()
    rng = random.Random(1000 + seed)
    with torch.no_grad():
        for longest in (rng.randint(1, 20), rng.randint(20, 300)):
            ids, mask = random_batch(lm.config, rng, longest)
            out = lm(ids, mask)
            assert_rows_match(out.logits, out.hidden_states, lm, ids, mask, ALONE_TOL)
            logits, hidden = static_forward(lm, ids, mask)
            assert_rows_match(logits, hidden, lm, ids, mask, BACKEND_TOL)


def test_4k_rows_left_and_right_padded_agree_in_torch() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(**random_config(3))).eval()
    ids = torch.randint(2, 40, (2, 4096), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :1000] = 0  # left padding
    mask[1, 3900:] = 0  # and right padding
    with torch.no_grad():
        out = lm(ids, mask)
        assert_rows_match(out.logits, out.hidden_states, lm, ids, mask, ALONE_TOL)


# ---- onnxruntime on one exported graph ---------------------------------------------------------------
LONG = dict(attn_layers=["local", "lsh"], axial_pos_shape=(128, 128), max_position_embeddings=16384)


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> tuple[ReformerLM, Path]:
    torch.manual_seed(0)
    lm = ReformerLM(tiny_config(**LONG)).eval()
    path = tmp_path_factory.mktemp("graph") / "model.onnx"
    ox.export_onnx(lm, path)
    return lm, path


def test_onnx_padded_batches_agree_with_rows_alone(graph: tuple[ReformerLM, Path]) -> None:
    lm, path = graph
    session = ox.ort_session(path)
    rng = random.Random(7)
    with torch.no_grad():
        for longest in (9, 200, 4000):
            ids, mask = random_batch(lm.config, rng, longest)
            logits, hidden = ox.run_ort(session, ids, mask)
            assert_rows_match(logits, hidden, lm, ids, mask, BACKEND_TOL)


def test_onnx_verification_covers_4k_and_padding_on_both_sides(graph: tuple[ReformerLM, Path]) -> None:
    lm, path = graph
    result = ox.verify_onnx(lm, path, seed=3)
    assert [4096] in result["cases"]
    assert result["max_abs_diff_hidden_states"] <= BACKEND_TOL and result["max_abs_diff_logits"] <= BACKEND_TOL
    layouts = set()
    for _, mask in ox.verification_cases(lm, seed=3):
        m = mask.bool()
        layouts |= {(bool(not row[0]), bool(not row[-1])) for row in m}
    assert {(True, False), (False, True), (True, True)} <= layouts  # left, right, both


@pytest.mark.slow
def test_onnx_verification_at_16k(graph: tuple[ReformerLM, Path]) -> None:
    lm, path = graph
    result = ox.verify_onnx(lm, path, seed=4, long=True)
    assert [16384] in result["cases"]
    assert result["max_abs_diff_hidden_states"] <= BACKEND_TOL and result["max_abs_diff_logits"] <= BACKEND_TOL
    (case,) = [c for c in result["hashing_cases"] if c["length"] == 16384]
    assert case["decisions"] > 0 and all(f["margin"] <= ox_ties.TIE_MARGIN for f in case["near_tie_flips"])
    assert case["whole_input"]["share_within_tolerance"] >= 0.99  # most positions agree logit by logit at 16K


def test_mask_with_a_hole_is_refused_by_torch_and_the_onnx_path_alike(graph: tuple[ReformerLM, Path]) -> None:
    lm, path = graph
    ids = torch.randint(2, 40, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, 4] = 0
    message = "attention_mask row 1 has padding between real tokens"
    with torch.no_grad(), pytest.raises(InvalidAttentionMask, match=message):
        lm(ids, mask)
    with pytest.raises(InvalidAttentionMask, match=message):
        ox.run_ort(ox.ort_session(path), ids, mask)
