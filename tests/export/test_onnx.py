"""ONNX export: parity with torch at lengths and batch sizes other than the traced ones, structure (opset,
names, dynamic axes, no random operators), refusal of a graph that disagrees, int8 quantisation."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from export import load_artifact, save_artifact
from export import onnx_export as ox
from export import onnx_ties as ties
from export.cli import export_main, verify_main
from export.quantize import BUILTIN_EVAL_TEXT, bits_per_byte_onnx, bits_per_byte_torch, read_eval_data
from model import ByteTokenizer
from tests.conftest import tiny_model
from tests.export.helpers import write_checkpoint

EVAL_TEXT = BUILTIN_EVAL_TEXT[:1500] + "\n\u00e9t\u00e9 \u2014 na\u00efve caf\u00e9\n".encode()


@pytest.fixture(scope="module")
def onnx_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One export (the slow part, ~1 min on 2 cores) shared by this module, made the way users make it:
    `reformer export CHECKPOINT OUT --quantize int8 --eval-data DIR` on a trainer-style checkpoint."""
    root = tmp_path_factory.mktemp("onnx")
    ckpt = write_checkpoint(root / "ckpt", seed=0)
    (root / "eval").mkdir()
    (root / "eval" / "held_out.txt").write_bytes(EVAL_TEXT)
    out = root / "artifact"
    assert export_main([str(ckpt), str(out), "--quantize", "int8", "--eval-data", str(root / "eval")]) == 0
    return out


def test_manifest_records_export_parity_and_hashes_the_graphs(onnx_artifact: Path) -> None:
    art = load_artifact(onnx_artifact)
    assert art.onnx_path == onnx_artifact / "model.onnx"
    assert art.onnx_int8_path == onnx_artifact / "model.int8.onnx"
    assert {"model.onnx", "model.int8.onnx"} <= set(art.manifest["files"])
    record = art.manifest["export"]["onnx"]
    assert record["opset"] >= 17
    assert 0.0 <= record["max_abs_diff"] <= 1e-4
    assert 0.0 <= record["parity"]["max_abs_diff_hidden_states"] <= 1e-4  # what the onnx backend pools
    # the verification covered short, chunk-multiple, non-multiple and padded-batch inputs
    cases = record["parity"]["cases"]
    assert [1] in cases and [8] in cases and [11] in cases
    assert any(len(c) > 1 and len(set(c)) > 1 for c in cases)


def test_graph_has_dynamic_axes_named_io_and_no_random_ops(onnx_artifact: Path) -> None:
    graph = onnx.load(str(onnx_artifact / "model.onnx"))
    assert [i.name for i in graph.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in graph.graph.output] == ["logits", "hidden_states"]
    for value in graph.graph.input:
        assert value.type.tensor_type.elem_type == onnx.TensorProto.INT64
        dims = value.type.tensor_type.shape.dim
        assert len(dims) == 2 and all(d.dim_param and not d.HasField("dim_value") for d in dims)
    ops = {n.op_type for n in graph.graph.node}
    assert not ops & ox.RANDOM_OPS
    assert not any(op.startswith("Random") for op in ops)
    assert not list(onnx_artifact.glob("*.data"))  # weights embedded, one file


@pytest.mark.parametrize("lengths,left", [([1], False), ([9], False), ([100], False), ([1000], False),
                                          ([17, 3, 40, 8], False), ([17, 3, 40, 8], True), ([900, 5, 64], True)])
def test_onnx_matches_torch_on_shapes_it_was_not_traced_with(onnx_artifact: Path, lengths: list[int],
                                                             left: bool) -> None:
    model = tiny_model()
    session = ox.ort_session(onnx_artifact / "model.onnx")
    g = torch.Generator().manual_seed(sum(lengths))
    t = max(lengths)
    ids = torch.randint(2, 258, (len(lengths), t), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        if left:
            mask[i, t - n :] = 1
        else:
            mask[i, :n] = 1
    logits, hidden = ox.run_ort(session, ids, mask)
    with torch.no_grad():
        ref = model(ids, mask)
    assert logits.shape == (len(lengths), t, 258) and hidden.shape == (len(lengths), t, 64)
    real = mask.bool().numpy()
    assert np.abs(logits - ref.logits.numpy())[real].max() <= 1e-4
    assert np.abs(hidden - ref.hidden_states.numpy())[real].max() <= 1e-4


def test_verify_command_rechecks_a_graph_with_fresh_inputs(onnx_artifact: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    assert verify_main([str(onnx_artifact), "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "max abs diff vs torch" in out
    assert "model.int8.onnx: runs" in out
    assert re.search(r"bits-per-byte change [+-]\d\.\d{4}", out)


def _drifted(output: str, drift: float) -> torch.nn.Module:
    """The exported model (tiny_model(seed=0)) with one weight moved so that onnxruntime on its graph differs
    from torch by exactly `drift` in one output: "logits" (one logit's bias) or "hidden_states" (one
    dimension of the final layer norm's bias, with the head's bias compensating so the logits stay put)."""
    model = tiny_model()
    with torch.no_grad():
        if output == "logits":
            model.lm_head.bias[5] += drift
        else:
            model.final_layer_norm.bias[3] += drift
            model.lm_head.bias -= model.lm_head.weight[:, 3] * drift
    return model


@pytest.mark.parametrize("output", ["logits", "hidden_states"])
def test_export_refuses_a_drift_just_over_the_tolerance(onnx_artifact: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch, output: str) -> None:
    # the "export" yields the unmodified model's graph, so the graph drifts from torch by 2x the tolerance
    def stale_export(model: object, path: Path, optimize: bool = True) -> dict[str, object]:
        shutil.copy(onnx_artifact / "model.onnx", path)
        return ox.check_graph(path)

    monkeypatch.setattr(ox, "export_onnx", stale_export)
    out = tmp_path / "refused"
    with pytest.raises(ox.ExportError, match=rf"model\.onnx: onnxruntime {output} differ from torch by 0\.000[12]"):
        save_artifact(_drifted(output, 2 * ox.PARITY_TOLERANCE), out, onnx=True)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory left behind
    # the same drift at half the tolerance passes: the gate sits at the tolerance, not far beyond it
    save_artifact(_drifted(output, 0.5 * ox.PARITY_TOLERANCE), tmp_path / "kept", onnx=True)
    assert (tmp_path / "kept" / "model.onnx").exists()


def _long_outputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 50, (2, 300), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 200:] = 0
    logits = (3 * torch.randn(2, 300, 50, generator=g)).numpy()
    hidden = (1 + torch.randn(2, 300, 16, generator=g)).numpy()
    return ids, mask, logits, hidden


def test_whole_input_parity_measures_likelihood_and_pooled_state_not_single_logits() -> None:
    ids, mask, logits, hidden = _long_outputs()
    same = ox.whole_input_parity(ids, mask, logits, hidden, logits.copy(), hidden.copy())
    assert same == {"length": 300, "nll_relative_diff": 0.0, "pooled_relative_diff": 0.0,
                    "max_abs_diff_logits": 0.0, "share_within_tolerance": 1.0}
    # a shift of every logit of some positions leaves their probabilities (and the likelihood) as they were
    shifted = logits.copy()
    shifted[0, 100:130] += 0.3
    case = ox.whole_input_parity(ids, mask, logits, hidden, shifted, hidden)
    assert case["nll_relative_diff"] < 1e-7 and case["max_abs_diff_logits"] == pytest.approx(0.3, abs=1e-5)
    assert case["share_within_tolerance"] == pytest.approx(1 - 30 / 500)  # 500 real positions
    # padding is not compared: garbage there changes nothing
    padded = logits.copy()
    padded[1, 200:] = 1e6
    assert ox.whole_input_parity(ids, mask, logits, hidden, padded, hidden)["max_abs_diff_logits"] == 0.0


def test_whole_input_parity_measures_what_a_length_specific_error_moves() -> None:
    ids, mask, logits, hidden = _long_outputs()
    # every real next token a little less likely: the likelihood moves (by more than 1e-4 relative)
    less_likely = logits.copy()
    for row in range(2):
        less_likely[row, np.arange(299), ids[row, 1:].numpy()] -= 0.01
    assert ox.whole_input_parity(ids, mask, logits, hidden, less_likely, hidden)["nll_relative_diff"] > 1e-4
    # hidden states of the later positions scaled by 1%: the pooled state moves (by more than 1e-3 relative)
    scaled = hidden.copy()
    scaled[:, 150:] *= 1.01
    assert ox.whole_input_parity(ids, mask, logits, hidden, logits, scaled)["pooled_relative_diff"] > 1e-3


def _shifted_ort(monkeypatch: pytest.MonkeyPatch, hashing: bool) -> None:
    """The shipped graph's logits moved by 0.3 in the cases that hash, or in those that do not (the graph fed
    torch's buckets, which checks the hashing cases, unchanged)."""
    real = ties.run_ort

    def run_ort(session: object, ids: torch.Tensor, mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        logits, hidden = real(session, ids, mask)
        if (int(mask.sum(dim=1).max()) > 8) == hashing:  # tiny_model: LSH chunks of 8
            logits = logits + 0.3
        return logits, hidden

    monkeypatch.setattr(ties, "run_ort", run_ort)


def test_hashing_cases_record_the_shipped_graphs_whole_input_figures_ungated(
        onnx_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    art = load_artifact(onnx_artifact)
    assert art.model.config.lsh_attn_chunk_length == 8 and art.onnx_path is not None
    _shifted_ort(monkeypatch, hashing=True)
    result = ox.verify_onnx(art.model, art.onnx_path, seed=2)
    assert result["hashing_cases"]
    for case in result["hashing_cases"]:
        assert case["whole_input"]["max_abs_diff_logits"] == pytest.approx(0.3, abs=1e-4)  # recorded
        assert case["fed_max_abs_diff_logits"] <= ox.PARITY_TOLERANCE  # what is gated
    # the same shift where nothing hashes is refused: those cases are held to the tolerance
    _shifted_ort(monkeypatch, hashing=False)
    with pytest.raises(ox.ExportError, match="onnxruntime logits differ from torch by 0.3"):
        ox.verify_onnx(art.model, art.onnx_path, seed=2)


def test_export_needs_a_fixed_bucket_count() -> None:
    with pytest.raises(ox.ExportError, match="fixed num_buckets"):
        ox.OnnxForward(tiny_model(num_buckets=None))


def test_int8_graph_is_quantised_and_its_quality_change_recorded(onnx_artifact: Path) -> None:
    manifest = json.loads((onnx_artifact / "manifest.json").read_text())
    ev = manifest["evaluation"]["int8"]
    assert ev["text"] == "eval-data" and ev["bytes"] == len(EVAL_TEXT)
    assert ev["bits_per_byte_change"] == pytest.approx(ev["bits_per_byte_int8"] - ev["bits_per_byte_fp32"])
    # the fp32 graph's figure is the torch model's figure
    torch_bpb = bits_per_byte_torch(tiny_model(), EVAL_TEXT, ByteTokenizer(), ev["window"])
    assert ev["bits_per_byte_fp32"] == pytest.approx(torch_bpb, abs=1e-4)
    int8_bpb = bits_per_byte_onnx(onnx_artifact / "model.int8.onnx", EVAL_TEXT, ByteTokenizer(), ev["window"])
    assert int8_bpb == pytest.approx(ev["bits_per_byte_int8"], abs=1e-6)
    ops = {n.op_type for n in onnx.load(str(onnx_artifact / "model.int8.onnx")).graph.node}
    assert ops & {"MatMulInteger", "DynamicQuantizeLinear", "DynamicQuantizeMatMul"}
    assert not ops & ox.RANDOM_OPS


def test_eval_data_is_the_tail_of_every_text_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"head of a\r\n" + b"x" * 50 + b"tail of a\r\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"only b\n")
    (tmp_path / "notes.md").write_bytes(b"not text data")
    text = read_eval_data(tmp_path, max_bytes_per_file=10)
    assert text == b"tail of a\n" + b"\n\n" + b"only b\n"
    with pytest.raises(FileNotFoundError, match="no such evaluation file"):
        read_eval_data(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.txt files"):
        read_eval_data(tmp_path / "empty")
