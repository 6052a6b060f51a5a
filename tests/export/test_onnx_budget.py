"""ONNX verification sized to the model (export/onnx_budget.py): small models keep the full set, a model
whose full set exceeds the budget is exported without the optimizer and verified on the cases it affords,
which the manifest says, which `reformer verify` repeats, and which still refuse a graph that differs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from export import load_artifact, save_artifact
from export import onnx_budget as ob
from export import onnx_export as ox
from export.cli import verify_main
from tests.conftest import tiny_model


def test_small_models_keep_the_full_verification() -> None:
    model = tiny_model()
    plan = ob.plan_verification(model)
    assert plan.cases is None and plan.optimize
    full = ob.case_tokens(ox.verification_cases(model, 0, long=True))
    assert plan.record == {"parameters": model.num_parameters(), "budget_parameter_tokens": ob.VERIFY_BUDGET,
                           "full_tokens": full, "scope": "full", "tokens": full}


def test_the_default_artifacts_size_is_verified_in_full() -> None:
    # the shipped artifact's model (1.1M parameters) is what `reformer export` makes by default
    assert ob.plan_verification(load_artifact().model).record["scope"] == "full"


def test_a_large_model_gets_the_core_cases_and_what_else_it_affords() -> None:
    model = tiny_model()
    m = 8  # lcm of the tiny config's chunk lengths
    params = model.num_parameters()
    core = ob.plan_verification(model, budget=1.0)  # affords nothing beyond the core
    assert not core.optimize and core.cases is not None
    rows = [[int(n) for n in mask.sum(dim=1)] for _, mask in core.cases]
    assert rows == [[1], [m + 3, m // 2], [m + 3, m // 2]]  # the long row alone is the right batch's first
    right, both = core.cases[1][1], core.cases[2][1]
    assert right[0].all()  # the long row, unpadded
    assert right[1, -1] == 0 and right[1, 0] == 1  # padded on the right
    assert both[1, 0] == 0 and both[1, -1] == 0  # padded on both sides
    assert core.record["scope"] == "reduced" and core.record["longest"] == m + 3
    assert "graph exported without onnxscript's optimizer" in core.record["why"]
    # a budget for 3m-1 more tokens adds that row, not the next
    more = ob.plan_verification(model, budget=params * (ob.case_tokens(core.cases) + 3 * m - 1))
    assert more.cases is not None
    assert [int(mask.sum()) for _, mask in more.cases[3:]] == [3 * m - 1]


@pytest.fixture(scope="module")
def reduced_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An artifact of the tiny model exported as if it were large (budget 1): unoptimized graph, core cases."""
    out = tmp_path_factory.mktemp("budget") / "artifact"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ob, "VERIFY_BUDGET", 1.0)
        save_artifact(tiny_model(), out, onnx=True)
    return out


def test_reduced_export_is_recorded_and_verify_repeats_it(reduced_artifact: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    onnx = load_artifact(reduced_artifact).manifest["export"]["onnx"]
    assert onnx["optimized"] is False
    assert onnx["verification"]["scope"] == "reduced"
    assert onnx["parity"]["cases"] == [[1], [11, 4], [11, 4]]
    assert onnx["max_abs_diff"] <= ox.PARITY_TOLERANCE
    monkeypatch.setattr(ob, "VERIFY_BUDGET", 1.0)
    assert verify_main([str(reduced_artifact)]) == 0
    assert "max abs diff vs torch" in capsys.readouterr().out


def test_reduced_cases_still_refuse_a_graph_that_differs(reduced_artifact: Path) -> None:
    art = load_artifact(reduced_artifact)
    with torch.no_grad():
        art.model.layers[0].feed_forward.output.weight.mul_(1.05)  # the graph keeps the original weights
    cases = ob.plan_verification(art.model, budget=1.0).cases
    with pytest.raises(ox.ExportError, match="differ from torch"):
        ox.verify_onnx(art.model, art.onnx_path or Path(), cases=cases)


def test_export_logs_its_plan(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ob, "VERIFY_BUDGET", 1.0)
    # the export itself is not what this checks: stub it, keep the planning and progress around it
    monkeypatch.setattr(ox, "export_and_verify", lambda model, path, cases, optimize: {"cases": len(cases or [])})
    with caplog.at_level(logging.INFO, logger="export.onnx_budget"):
        info = ob.export_sized(tiny_model(), tmp_path / "model.onnx")
    assert info["cases"] == 3 and info["verification"]["scope"] == "reduced"  # 1 + 2 x 11 + 2 x 11 tokens
    assert "verifying it on 3 cases (reduced, 45 tokens)" in caplog.text
