"""bench/prefill/prefill_cost.py: another commit's model package imported beside this tree's, and a tiny A/B run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import bench.prefill.prefill_cost as prefill_cost


def test_a_run_against_head_times_both_and_compares_their_logits(tmp_path: Path) -> None:
    out = tmp_path / "prefill_cost.json"
    (tmp_path / prefill_cost.BOOK).write_text("It was the best of times, it was the worst of times. " * 400)
    try:
        assert prefill_cost.main(["--against", "HEAD", "--cases", "1x100,2x70", "--reps", "2",
                                  "--data", str(tmp_path), "--out", str(out)]) == 0
        # the other side ran the archived package, not this tree's model/ under another name
        archived = Path(sys.modules[f"{prefill_cost.OLD}.decoding"].__file__ or "")
        assert prefill_cost.OLD in archived.parts and prefill_cost.ROOT not in archived.parents
    finally:  # the imported package stays importable by name only inside this test
        for name in [m for m in sys.modules if m == prefill_cost.OLD or m.startswith(prefill_cost.OLD + ".")]:
            del sys.modules[name]
    result = json.loads(out.read_text())
    assert len(result["against_commit"]) == 40
    assert [(r["prompts"], r["bytes"], r["reps"]) for r in result["rows"]] == [(1, 100, 2), (2, 70, 2)]
    for row in result["rows"]:
        assert row["this_tree_ms"] > 0 and row["against_ms"] > 0
        # HEAD's model code is this tree's, give or take uncommitted edits: the same logits within rounding
        assert row["logits_max_abs_diff"] <= 1e-4


def test_a_run_against_another_artifact_prefills_both_models_with_this_trees_code(tmp_path: Path) -> None:
    from export import save_artifact
    from model import ByteTokenizer
    from tests.conftest import tiny_model

    artifacts = []
    for hashes in (2, 4):  # the same weights at two hash-round counts: only the hashing differs
        artifacts.append(tmp_path / f"h{hashes}")
        save_artifact(tiny_model(num_hashes=hashes), artifacts[-1], tokenizer=ByteTokenizer(),
                      provenance={"note": "random weights for tests"}, onnx=False)
    out = tmp_path / "prefill_cost.json"
    (tmp_path / prefill_cost.BOOK).write_text("It was the best of times, it was the worst of times. " * 400)
    assert prefill_cost.main(["--artifact", str(artifacts[0]), "--against-artifact", str(artifacts[1]),
                              "--cases", "1x100", "--reps", "2", "--data", str(tmp_path), "--out", str(out)]) == 0
    assert prefill_cost.OLD not in sys.modules  # no other commit's package was imported
    result = json.loads(out.read_text())
    assert result["against_artifact"] == str(artifacts[1]) and result["against_commit"] is None
    (row,) = result["rows"]
    assert row["this_tree_ms"] > 0 and row["against_ms"] > 0
    assert row["logits_max_abs_diff"] > 0  # two rounds and four hash differently, so the models really differ
