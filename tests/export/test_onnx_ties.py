"""The tie-aware ONNX check (export/onnx_ties.py, export/onnx_buckets.py): bucket tensors found by structure, a
hash near-tie accepted and recorded, a flip that is no tie, swapped hash rounds and a wrong constant refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from export import load_artifact
from export import onnx_buckets as ob
from export import onnx_export as ox
from export import onnx_ties as ties
from model import ReformerLM
from model.attention import LSHSelfAttention
from model.lsh.hashing import hash_rotations, rotation_size
from tests.conftest import tiny_model

LAYERS = ["local", "lsh", "local", "lsh"]  # the default artifact's layout, at tiny size
NEAR_TIE_SEED = 2  # its 2,048-token input has a decision within 2.3e-6 of a tie (found by scanning seeds 0-5)


def _model() -> ReformerLM:
    return tiny_model(attn_layers=LAYERS, num_hashes=4)


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ties") / "model.onnx"
    ox.export_onnx(_model(), path)
    return path


def _row(seed: int, length: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(2, 258, (1, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def _rotations(model: ReformerLM) -> torch.Tensor:
    cfg = model.config
    assert cfg.num_buckets is not None
    return hash_rotations(cfg.hash_seed, cfg.num_attention_heads, cfg.attention_head_size, cfg.num_hashes,
                          rotation_size(cfg.num_buckets))  # (H, D, R, K)


def _ranked_decisions(model: ReformerLM, ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch's relative top-two margins (H, R, L) of one LSH layer's decisions, and each decision's runner-up
    bucket (H, R, L) (num_buckets 4: candidates [x0, x1, -x0, -x1] are buckets 0-3)."""
    with torch.no_grad(), ties.capture_hashes(model) as hashes:
        model(ids)
    (qk,) = [h.qk for h in hashes if h.layer == layer]
    values = torch.einsum("bhld,hdrk->bhrlk", qk.double(), _rotations(model).double())[0]  # (H, R, L, K)
    top = torch.cat([values, -values], dim=-1).topk(2, dim=-1)
    return (top.values[..., 0] - top.values[..., 1]) / top.values[..., 0].abs(), top.indices[..., 1]


def _force_torch_bucket(model: ReformerLM, monkeypatch: pytest.MonkeyPatch, layer: int, head: int, rnd: int,
                        pos: int, bucket: int) -> None:
    """Make the eager model hash one decision to `bucket` (and attend with it), as another implementation's
    rounding would."""
    att = model.layers[layer].attention.self_attention  # type: ignore[union-attr]
    assert isinstance(att, LSHSelfAttention)
    real = att.hash

    def hash_with_flip(qk: torch.Tensor, num_buckets: int | list[int], valid: torch.Tensor | None) -> torch.Tensor:
        out = real(qk, num_buckets, valid).clone()
        out[0, head, rnd, pos] = bucket
        return out

    monkeypatch.setattr(att, "hash", hash_with_flip)


def test_bucket_tensors_are_found_by_structure_one_per_lsh_layer(graph: Path) -> None:
    model = onnx.load(str(graph))
    sites = ob.find_bucket_sites(model, 2)
    assert len(sites) == 2 and len({s.tensor for s in sites}) == 2
    # what the buckets are a product of: the rotations, as torch draws them
    initializers = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    expected = _rotations(_model()).reshape(2, 16, -1).numpy()
    assert all(np.array_equal(initializers[s.rotations], expected) for s in sites)
    with pytest.raises(ox.ExportError, match="found 2 LSH bucket tensors in the graph; the model has 3 LSH layers"):
        ob.find_bucket_sites(model, 3)


def test_a_near_tie_flip_is_accepted_and_recorded(graph: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    ids, mask = _row(NEAR_TIE_SEED)
    margins, runner_up = _ranked_decisions(model, ids, layer=1)
    head, rnd, pos = (int(i) for i in np.unravel_index(int(margins.argmin()), tuple(margins.shape)))
    assert float(margins.min()) <= 1e-5  # the input has a near-tie to flip
    # torch takes the runner-up there; the graph's hash keeps the winner: a near-tie flip
    _force_torch_bucket(model, monkeypatch, 1, head, rnd, pos, int(runner_up[head, rnd, pos]))
    record = ties.TieCheck(model, graph).check(ids, mask)
    (flip,) = record["flips"]
    assert {k: flip[k] for k in ("layer", "round", "head", "row", "position")} == \
        {"layer": 1, "round": rnd, "head": head, "row": 0, "position": pos}
    assert flip["margin"] == pytest.approx(float(margins.min()), rel=1e-3)
    assert flip["torch_bucket"] == int(runner_up[head, rnd, pos]) != flip["onnx_bucket"]
    assert record["decisions"] == 2 * 2 * 4 * 2048  # layers x heads x rounds x positions
    # the flip moved the shipped graph's output away from torch's: the strict gate could not have passed it
    assert record["whole_input"]["max_abs_diff_logits"] > ox.PARITY_TOLERANCE
    assert record["logits"] <= 1e-4  # with torch's buckets fed, the rest of the graph agrees


def test_a_flip_that_is_no_tie_is_refused(graph: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    ids, mask = _row(NEAR_TIE_SEED)
    margins, runner_up = _ranked_decisions(model, ids, layer=3)
    head, rnd, pos = 1, 2, 700
    assert float(margins[head, rnd, pos]) > 1e-3
    _force_torch_bucket(model, monkeypatch, 3, head, rnd, pos, int(runner_up[head, rnd, pos]))
    with pytest.raises(ox.ExportError, match=f"layer 3 round {rnd} head {head} row 0 position {pos} .*not a hash "
                                             "near-tie"):
        ties.TieCheck(model, graph).check(ids, mask)


def _swapped_rounds(graph: Path, out: Path) -> Path:
    """The graph with hash rounds 0 and 1 of the second LSH layer swapped (its product reads a new constant)."""
    model = onnx.load(str(graph))
    site = ob.find_bucket_sites(model, 2)[1]
    rot = _rotations(_model())
    swapped = rot[:, :, [1, 0, 2, 3]].reshape(2, 16, -1).numpy()
    model.graph.initializer.append(numpy_helper.from_array(swapped, "swapped_rotations"))
    (node,) = [n for n in model.graph.node if n.output[0] == site.product]
    node.input[list(node.input).index(site.rotations)] = "swapped_rotations"
    onnx.save(model, str(out))
    return out


def test_swapped_hash_rounds_are_refused(graph: Path, tmp_path: Path) -> None:
    model = _model()
    bad = _swapped_rounds(graph, tmp_path / "swapped.onnx")
    ids, mask = _row(0)
    # what the old check saw: the swapped graph's output agrees with torch's everywhere
    logits, hidden = ox.run_ort(ox.ort_session(bad), ids, mask)
    with torch.no_grad():
        ref = model(ids, mask)
    assert np.abs(logits - ref.logits.numpy()).max() <= ox.PARITY_TOLERANCE
    assert np.abs(hidden - ref.hidden_states.numpy()).max() <= ox.PARITY_TOLERANCE
    with pytest.raises(ox.ExportError, match=r"hashes layer 3 round 0 .*not a hash near-tie"):
        ox.verify_onnx(model, bad)


def test_a_wrong_constant_is_refused(graph: Path, tmp_path: Path) -> None:
    model = _model()
    onnx_model = onnx.load(str(graph))
    att = model.layers[3].attention.self_attention  # type: ignore[union-attr]
    weight = att.value.weight.detach().T.numpy()  # type: ignore[union-attr, operator]
    (init,) = [i for i in onnx_model.graph.initializer if np.array_equal(numpy_helper.to_array(i), weight)]
    init.CopyFrom(numpy_helper.from_array(weight * np.float32(1.01), init.name))  # 1% off
    bad = tmp_path / "wrong.onnx"
    onnx.save(onnx_model, str(bad))
    # the tiny model's logits move by 6e-5 only; its hidden states (what embeddings pool) by 4.8e-4
    with pytest.raises(ox.ExportError, match=r"onnxruntime hidden_states differ from torch by 0\.000[45]\d* at 300 "
                                             "tokens with torch's LSH buckets fed to the graph"):
        ties.TieCheck(model, bad).check(*_row(0, 300))


def test_the_manifest_record_of_a_graph_that_passes(graph: Path) -> None:
    found = ox.verify_onnx(_model(), graph, seed=0)
    lengths = [c["length"] for c in found["hashing_cases"]]
    assert 2048 in lengths and all(n > 8 for n in lengths)  # every case longer than one LSH chunk hashes
    for case in found["hashing_cases"]:
        assert case["decisions"] > 0 and case["near_tie_flips"] == []
        assert set(case["whole_input"]) == {"length", "nll_relative_diff", "pooled_relative_diff",
                                            "max_abs_diff_logits", "share_within_tolerance"}
    assert found["near_tie_flips"] == 0 and found["tie_margin"] == ties.TIE_MARGIN
    assert found["max_abs_diff_logits"] <= ox.PARITY_TOLERANCE  # the cases that do not hash
    assert 0.0 < found["fed_max_abs_diff_logits"] == max(c["fed_max_abs_diff_logits"] for c in found["hashing_cases"])


def test_decision_margins_take_the_factor_whose_digit_differs() -> None:
    # one head, one round, identity rotations: the rotated values are x itself; factors [4, 4] read x[0:2]
    # (low digit) and x[2:4] (high digit)
    rotations = torch.eye(4).view(1, 4, 1, 4)
    qk = torch.tensor([[[[1.0, 0.999, -3.0, 0.5]]]])  # (B, H, L, D)
    flips = np.array([[0, 0, 0, 0]])
    # torch's bucket: low digit 0 (x[0] = 1 of [1, .999, -1, -.999]), high digit 2 (-x[2] = 3 of [-3, .5, 3, -.5])
    torch_bucket = np.array([0 + 4 * 2])
    # the low digit differs (1: the runner-up .999): margin (1 - .999) / 1
    low = ties.decision_margins(qk, rotations, [4, 4], flips, np.array([1 + 4 * 2]), torch_bucket)
    assert low[0] == pytest.approx(1e-3, rel=1e-4)  # 0.999 in float32
    # the high digit differs (1: the runner-up .5): margin (3 - .5) / 3
    high = ties.decision_margins(qk, rotations, [4, 4], flips, np.array([0 + 4 * 1]), torch_bucket)
    assert high[0] == pytest.approx(2.5 / 3)


def test_the_documented_near_tie_of_the_default_artifact_passes() -> None:
    """The case that refused the 4-round default on 2026-12-06: the 389-token row of its export's verification
    cases (seed 0), whose first LSH layer (layer 1) has round 0, head 3, position 110 within 1.7e-7 of a tie.
    onnxruntime flipped that decision where it was documented (the whole input's mean log-likelihood then
    moved by 2.46e-4 relative, the largest logit by 2.16); elsewhere its rounding may not, and the check must
    pass either way."""
    art = load_artifact()
    assert art.onnx_path is not None
    ids, mask = [c for c in ox.verification_cases(art.model, seed=0, long=True) if c[0].shape[1] == 389][0]
    margins, _ = _ranked_decisions(art.model, ids, layer=1)
    assert float(margins[3, 0, 110]) <= 1e-6  # the documented near-tie is in the case
    record = ties.TieCheck(art.model, art.onnx_path).check(ids, mask)
    assert record["hashes"] and record["decisions"] == 2 * 4 * 4 * 389
    assert [(f["layer"], f["round"], f["head"], f["position"]) for f in record["flips"]] in ([], [(1, 0, 3, 110)])
    if record["flips"]:
        assert record["flips"][0]["margin"] <= ties.TIE_MARGIN
        assert record["whole_input"]["nll_relative_diff"] > 1e-4  # what the whole-input gate refused
