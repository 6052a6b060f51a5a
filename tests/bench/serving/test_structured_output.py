"""The structured-output benchmark's short form on the tiny test model (bench/serving/structured_output.py has
the full one): every finished answer validates against its schema, refusals are reported with their reason,
and its corpus is what bench/serving/structured_corpus.py writes from its sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.serving import structured_corpus
from bench.serving.structured_corpus import read_corpus
from bench.serving.structured_output import compile_all, run
from model import ByteTokenizer


@pytest.mark.timeout(180)
def test_a_short_run_validates_every_finished_answer(tiny_artifact: Path, tmp_path: Path) -> None:
    report = run(tiny_artifact, max_tokens=48, steps=8, rounds=1, concurrency=4, limit=8, log_dir=tmp_path)
    answers = report["answers"]
    assert answers["sent"] == report["coverage"]["compiled"] == 8 and answers["not_200"] == []
    assert answers["invalid"] == [] and answers["valid"] == answers["finished"] > 0
    for batch in ("batch_1", "batch_8"):
        figures = report["decode_step"][batch]
        assert set(figures["ratio_to_unconstrained"]) == {"json_schema", "any_text"}
        assert all(v > 0 for v in figures["median_mask_s_per_batch"].values())


def test_schemas_the_engine_refuses_are_reported_with_the_reason() -> None:
    schemas = read_corpus()
    refused = [s for s in schemas if "if" in s["schema"] or "dependentSchemas" in s["schema"]]
    assert refused, "the corpus keeps constructs llguidance refuses, so coverage is measured"
    results = compile_all(ByteTokenizer(), refused[:2] + schemas[:2])
    assert [r["compiled"] for r in results] == [False, False, True, True]
    assert all("Unimplemented keys" in r["why"] for r in results[:2])


def test_the_corpus_is_what_its_script_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("kubernetes_validate")
    out = tmp_path / "corpus.json.gz"
    monkeypatch.setattr("sys.argv", ["structured_corpus.py", "--out", str(out)])
    structured_corpus.main()
    assert out.read_bytes() == structured_corpus.OUT.read_bytes() and len(read_corpus()) >= 200
