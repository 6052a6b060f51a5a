"""The long-range recipe's pieces: passkey and copy documents (train/long_docs.py), the training windows and
their answer masks (train/mixer.py), the options and curriculum (train/recipe.py), the corpus selection
(train/corpus.py), and `reformer train` with the recipe on (answer-loss columns, provenance, resume)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from train import corpus as corpus_module
from train.corpus import check_listed_digests, listed_digests, resolve_sources, select_files
from train.data import DataError, TokenFile
from train.long_docs import (
    PASSKEY_OVERHEAD,
    QUESTION,
    STANDARD_FILLER,
    TASK,
    copy_control,
    copy_document,
    log_uniform_gap,
    needle,
    passkey_document,
    random_key,
    random_passage,
    repeat_document,
    standard_filler,
    utf8_safe,
)
from train.loop import main as train_main
from train.mixer import COPY, PASSKEY, PROSE, MixedSampler, build_row, heldout_rows, to_bytes, to_ids
from train.recipe import Mix, RecipeConfig, Stage, lsh_reach, parse_curriculum, parse_mix, stage_at
from train.recipe_run import AnswerMeter, make_weighted_loss_fn

PROSE_TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
              "foolishness, \u201cit was the epoch of belief\u201d, caf\u00e9 cr\u00e8me. ").encode() * 400


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_passkey_answer_is_its_key_at_the_stated_depth(depth: float) -> None:
    prose = b"abcdefghij " * 300
    doc = passkey_document(prose, "68432", depth, 1024)
    assert len(doc.data) == 1024 and doc.data.startswith(TASK + b"\n")
    assert doc.prompt.endswith(QUESTION) and doc.answer_bytes == b"68432" and doc.answer == (1019, 1024)
    filler = 1024 - PASSKEY_OVERHEAD
    before = round(depth * filler)
    at = len(TASK) + 1 + before + 1  # the hidden sentence starts after the task line and `before` prose bytes
    assert doc.data[at:at + len(needle("68432"))] == needle("68432")
    assert doc.data[doc.source[0]:doc.source[1]] == b"68432" and doc.data.count(b"68432") == 3
    assert doc.gap == filler - before  # prose between the hidden sentence and the question
    assert doc.data[len(TASK) + 1:at - 1] == prose[:before]


def test_passkey_rejects_bad_keys_and_short_lengths() -> None:
    with pytest.raises(ValueError, match="5 digits"):
        passkey_document(b"x" * 2000, "1234", 0.5, 1024)
    with pytest.raises(ValueError, match="at least"):
        passkey_document(b"x" * 2000, "12345", 0.5, PASSKEY_OVERHEAD - 1)
    with pytest.raises(ValueError, match="prose bytes"):
        passkey_document(b"x" * 10, "12345", 0.5, 1024)
    assert len(passkey_document(b"", "12345", 0.5, PASSKEY_OVERHEAD).data) == PASSKEY_OVERHEAD


@pytest.mark.parametrize("gap", [0, 1, 500])
def test_copy_document_holds_its_passage_twice_at_the_stated_gap(gap: int) -> None:
    prose = bytes(range(32, 127)) * 20
    doc = copy_document(prose, 140, gap, 60)
    assert len(doc.data) == 280 + gap and doc.gap == gap
    assert doc.data[:140] == prose[:140] == doc.data[140 + gap:280 + gap]
    assert doc.data[140:140 + gap] == prose[140:140 + gap]
    assert doc.answer == (140 + gap + 60, 280 + gap) and doc.answer_bytes == prose[60:140]
    assert doc.data[doc.source[0]:doc.source[1]] == doc.answer_bytes
    control = copy_control(doc, b"Z" * 140)
    assert control.data[:140] == b"Z" * 140 and control.data[140:] == doc.data[140:]
    assert control.answer_bytes == doc.answer_bytes and control.prompt[140:] == doc.prompt[140:]
    with pytest.raises(ValueError, match="cue"):
        copy_document(prose, 60, gap, 60)


def test_documents_from_cut_unicode_prose_decode() -> None:
    for cut in range(0, 12):
        piece = PROSE_TEXT[cut:cut + 400 + cut]
        assert len(utf8_safe(piece)) == len(piece)
        utf8_safe(piece).decode("utf-8")
        passkey_document(PROSE_TEXT[cut:], "10000", cut / 11, 600 + cut).data.decode("utf-8")
        copy_document(PROSE_TEXT[cut:], 140, 100 + cut, 60).data.decode("utf-8")
    assert utf8_safe("\u201cab\u201d".encode()[1:-1]) == b"  ab  "


def test_keys_and_documents_are_determined_by_the_seed() -> None:
    keys = [random_key(np.random.default_rng(s)) for s in range(50)]
    assert all(len(k) == 5 and k.isdigit() and k[0] != "0" for k in keys)
    assert keys == [random_key(np.random.default_rng(s)) for s in range(50)] and len(set(keys)) > 40


RECIPE = RecipeConfig(mix=Mix(passkey=0.4, copy=0.3, prose=0.3))


def _prose_ids(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return to_ids(bytes(rng.choice(list(b"abcdefgh ijklmnop\n"), size=n).astype(np.uint8)))


def _spans(mask: np.ndarray) -> list[tuple[int, int, int]]:
    from train.recipe_run import answer_spans

    return answer_spans(mask)


def _copy_source(data: bytes, a: int, b: int, cue: int) -> int:
    """Where the passage whose repeat's answer is bytes [a, b) of `data` first appears (its start)."""
    repeat = data[a - cue:b]
    first = data.find(repeat)
    assert first + len(repeat) <= a - cue  # the whole passage (cue and answer) occurs before its repeat
    return first


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("kind", [PASSKEY, COPY])
def test_window_mask_covers_exactly_the_answer_bytes(kind: int, pack: bool) -> None:
    recipe = dataclasses.replace(RECIPE, pack=pack)
    stage = Stage(window=1400, batch_size=2, gap=1400)
    counts = []
    for seed in range(30):
        ids, mask = build_row(kind, _prose_ids(1401, seed), np.random.default_rng(seed), stage, recipe)
        assert ids.shape == (1401,) and mask.shape == (1400,)
        data = to_bytes(ids)
        assert set(mask.tolist()) == {0, kind}
        spans = _spans(mask)
        counts.append(len(spans))
        for a, b, _ in spans:
            answer = data[a + 1:b + 1]  # target t predicts byte t + 1
            if kind == PASSKEY:
                assert len(answer) == 5 and data[:a + 1].endswith(QUESTION)
                assert b"The pass key is " + answer + b". Remember it." in data[:a + 1]
            else:
                n = b - a + RECIPE.copy_cue
                assert RECIPE.copy_passage_min <= n <= RECIPE.copy_passage
                _copy_source(data, a + 1, b + 1, RECIPE.copy_cue)
    assert max(counts) == 1 if not pack else max(counts) >= 3
    ids, mask = build_row(PROSE, _prose_ids(701), np.random.default_rng(0), stage, RECIPE)
    assert not mask.any() and (ids == _prose_ids(701)).all()


def test_answers_land_anywhere_in_the_window_and_gaps_follow_the_stage() -> None:
    ends = []
    stage = Stage(window=2048, batch_size=1, gap=2048)
    for seed in range(200):
        ids, mask = build_row(PASSKEY, _prose_ids(2049, seed), np.random.default_rng(seed), stage, RECIPE)
        ends.append(int(np.flatnonzero(mask)[0]))
    assert min(ends) < 600 and max(ends) > 1900  # not one fixed slot for position embeddings to learn
    for gap_max in (100, 2048):
        gaps = []
        for seed in range(60):
            ids, mask = build_row(COPY, _prose_ids(2049, seed), np.random.default_rng(seed),
                                  Stage(window=2048, batch_size=1, gap=gap_max), RECIPE)
            data = to_bytes(ids)
            for a, b, _ in _spans(mask):
                start = a + 1 - RECIPE.copy_cue  # the repeat's first byte
                n = b - a + RECIPE.copy_cue
                gaps.append(start - (_copy_source(data, a + 1, b + 1, RECIPE.copy_cue) + n))
        assert min(gaps) >= 0 and max(gaps) <= gap_max
        near = sum(g < 64 for g in gaps) / len(gaps)
        assert near > 0.2  # log-uniform from --gap-min: gaps inside the local window are common
        if gap_max == 2048:
            assert max(gaps) > 512  # and far ones are drawn too


def test_copy_passages_are_random_or_prose_and_passkey_fillers_both_appear() -> None:
    stage = Stage(window=2048, batch_size=1, gap=2048)
    random_like = prose_like = standard = prose_filler = 0
    for seed in range(40):
        ids, mask = build_row(COPY, _prose_ids(2049, seed), np.random.default_rng(seed), stage, RECIPE)
        data = to_bytes(ids)
        for a, b, _ in _spans(mask):
            answer = set(data[a + 1:b + 1])
            if answer <= set(b"abcdefgh ijklmnop\n"):
                prose_like += 1
            else:
                random_like += 1
        ids, mask = build_row(PASSKEY, _prose_ids(2049, seed), np.random.default_rng(seed), stage, RECIPE)
        data = to_bytes(ids)
        standard += data.count(b"The grass is green.") > 0
        prose_filler += data.count(b"The grass is green.") == 0
    assert random_like > 10 and prose_like > 10 and standard > 5 and prose_filler > 5


def test_standard_filler_random_passages_and_log_uniform_gaps() -> None:
    assert standard_filler(10) == STANDARD_FILLER[:10] and len(standard_filler(1000)) == 1000
    assert standard_filler(2 * len(STANDARD_FILLER)) == STANDARD_FILLER * 2
    rng = np.random.default_rng(0)
    p = random_passage(rng, 200)
    assert len(p) == 200 and set(p) <= set(range(32, 127)) and len(set(p)) > 50
    doc = repeat_document(p[:40], b"x" * 300, 100, 2)
    assert doc.data == p[:40] + b"x" * 100 + p[:40] and doc.answer_bytes == p[2:40] and doc.gap == 100
    assert doc.prose_used == 100 and doc.data[doc.source[0]:doc.source[1]] == doc.answer_bytes
    gaps = np.array([log_uniform_gap(rng, 8, 2048) for _ in range(4000)])
    assert gaps.min() >= 8 and gaps.max() <= 2048 and gaps.max() > 1500
    # log-uniform: each factor-of-4 band holds about the same share (8-32, 128-512)
    low, mid = np.mean((gaps >= 8) & (gaps < 32)), np.mean((gaps >= 128) & (gaps < 512))
    assert 0.15 < low < 0.35 and 0.15 < mid < 0.35
    assert log_uniform_gap(rng, 8, 5) == 5 and log_uniform_gap(rng, 0, 0) == 0


def test_curriculum_stages_and_mix_parse_and_select_by_step() -> None:
    stages = parse_curriculum("512x8@256:400, 1024x4:1600,2048x2")
    assert stages == (Stage(512, 8, 256, 400), Stage(1024, 4, 1024, 1600), Stage(2048, 2, 2048, None))
    assert [stage_at(stages, s) for s in (0, 399, 400, 1599, 1600, 10**6)] == [0, 0, 1, 1, 2, 2]
    assert stage_at(stages, 10, floor=1) == 1  # reached early by --advance-at
    for bad in ("512x8,1024x4", "512x8:400,1024x4:300", "512:400", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_curriculum(bad)
    assert parse_mix("passkey=0.3,copy=0.2,prose=0.5") == Mix(0.3, 0.2, 0.5)
    assert parse_mix("passkey=1") == Mix(1.0, 0.0, 0.0)
    for bad in ("passkey=0.3", "key=1", "passkey=x,prose=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mix(bad)
    assert lsh_reach(64, 64, 1) == 8192 and lsh_reach(None, 64, 1) is None and lsh_reach([8, 8], 64, 1) == 8192


def _token_file(tmp_path: Path, n: int) -> TokenFile:
    from train.data import Segment

    ids = _prose_ids(n).astype(np.uint16)
    (tmp_path / "t.bin").write_bytes(ids.tobytes())
    return TokenFile(tmp_path / "t.bin", [Segment("t.txt", 0, n)])


def test_sampler_is_a_function_of_the_seed_and_heldout_documents_are_fixed(tmp_path: Path) -> None:
    data = _token_file(tmp_path, 20000)
    stage = Stage(512, 6, 512)
    a = MixedSampler(data, stage, RECIPE, seed=3)
    b = MixedSampler(data, stage, RECIPE, seed=3)
    ids_a, kinds_a = a.global_batch(a.rng(5, 0), 6)
    ids_b, kinds_b = b.global_batch(b.rng(5, 0), 6)
    assert (ids_a == ids_b).all() and (kinds_a == kinds_b).all() and ids_a.shape == (6, 513)
    ids_c, _ = a.global_batch(a.rng(6, 0), 6)
    assert not (ids_a == ids_c).all()
    rows = heldout_rows(data, stage, RECIPE, PASSKEY)
    again = heldout_rows(data, stage, RECIPE, PASSKEY)
    assert len(rows) == 16 and all((r[0] == s[0]).all() for r, s in zip(rows, again, strict=True))


def test_weighted_loss_adds_the_answer_mean_and_the_meter_keeps_it_apart() -> None:
    from tests.conftest import tiny_model

    lm = tiny_model()
    ids = torch.randint(2, 258, (2, 33))
    kinds = torch.zeros(2, 32, dtype=torch.int8)
    kinds[0, 10:15] = PASSKEY
    kinds[1, 20:30] = COPY
    fn = make_weighted_loss_fn(lm, None, "cpu", RecipeConfig(answer_weight=2.0, prose_weight=0.5))
    loss, ce = fn(ids, 0, kinds)
    answer = ce[kinds > 0].mean()
    assert torch.allclose(loss, 0.5 * ce.mean() + 2.0 * answer)
    plain, _ = make_weighted_loss_fn(lm, None, "cpu", RecipeConfig())(ids, 0, torch.zeros_like(kinds))
    assert torch.allclose(plain, ce.mean())  # no answers: the plain mean
    meter = AnswerMeter()
    meter.add(ce, kinds)
    from train.runtime import DistInfo

    s = meter.summary(DistInfo(), torch.device("cpu"))
    assert s["train_passkey_loss"] == round(float(ce[0, 10:15].mean()), 4)
    assert s["train_answer_loss"] == round(float(answer), 4)
    assert meter.summary(DistInfo(), torch.device("cpu"))["train_answer_loss"] is None  # reset


def test_corpus_selection_defaults_patterns_and_listed_digests(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the named sets point at folders made here, so the test does not depend on `reformer data` having run
    shared = {name: tmp_path / "shared" / name for name in ("data", "corpus")}
    monkeypatch.setattr(corpus_module, "NAMED_SETS", shared)
    with pytest.raises(DataError, match="--corpus data: .* is not a directory"):
        resolve_sources([], None)
    for folder in shared.values():
        folder.mkdir(parents=True)
    assert resolve_sources([], None) == [shared["data"], shared["corpus"]]
    assert resolve_sources([], ["corpus"]) == [shared["corpus"]]
    assert resolve_sources(["x"], None) == [Path("x")]
    d = tmp_path / "books"
    d.mkdir()
    for name in ("alpha.txt", "beta.txt", "gamma.txt"):
        (d / name).write_text(name * 50)
    assert [f.name for f in select_files([d], ["a*", "b*"], ["beta*"])] == ["alpha.txt"]
    with pytest.raises(DataError, match="matches none"):
        select_files([d], ["zeta*"])
    digest = hashlib.sha256((d / "alpha.txt").read_bytes()).hexdigest()
    (d / "README.md").write_text(f"| file | bytes | sha256 |\n|---|---:|---|\n| alpha.txt | 450 | {digest[:16]} |\n"
                                 f"{'0' * 64}  beta.txt\n")
    assert listed_digests(d / "README.md") == {"alpha.txt": digest[:16], "beta.txt": "0" * 64}
    check_listed_digests([d / "alpha.txt", d / "gamma.txt"])
    with pytest.raises(DataError, match="differs"):
        check_listed_digests([d / "beta.txt"])


TINY = ["--hidden-size", "32", "--num-heads", "2", "--attn-layers", "local,lsh", "--feed-forward-size", "64",
        "--chunk-length", "16", "--num-buckets", "4", "--axial-pos-shape", "16,64", "--max-positions", "1024",
        "--warmup-steps", "2", "--lr", "3e-3", "--threads", "1", "--val-windows", "2", "--no-progress",
        "--retrieval-val-docs", "2"]


def test_train_with_the_recipe_logs_answer_loss_and_records_the_recipe(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(" ".join(["the king said to the queen"] * 400) + "\n")
    out = tmp_path / "run"
    common = [str(corpus), "--out", str(out), "--eval-every", "2", "--mix", "passkey=0.5,copy=0.25,prose=0.25",
              "--curriculum", "400x2@100:2,500x2", "--answer-weight", "1.5", "--advance-at", "1.0", *TINY]
    assert train_main([*common, "--max-steps", "4", "--stop-at-step", "2"]) == 0
    assert train_main([*common, "--max-steps", "4", "--resume"]) == 0
    rows = list(csv.DictReader((out / "curve.csv").open()))
    # validations at step 0 (the starting model), 2 (interval, then end of the first run), 4 (interval, end)
    assert [r["step"] for r in rows] == ["0", "2", "2", "4", "4"]
    assert [r["stage"] for r in rows] == ["0", "0", "0", "1", "1"] and rows[-1]["window"] == "500"
    assert rows[0]["train_answer_loss"] == "" and float(rows[0]["val_passkey_loss"]) > 0
    assert float(rows[1]["train_answer_loss"]) > 0 and float(rows[3]["train_answer_loss"]) > 0
    assert rows[2]["train_answer_loss"] == ""  # no step between the two validations at step 2
    assert 0 <= float(rows[1]["val_passkey_acc"]) <= 1 and float(rows[4]["val_copy_loss"]) > 0
    meta = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert meta["args"]["answer_weight"] == "1.5"
    from train.checkpoint import read_checkpoint_metadata

    prov = read_checkpoint_metadata(out / "checkpoint")["provenance"]
    assert prov["recipe"]["answer_weight"] == 1.5 and prov["recipe"]["stages"][0] == {
        "window": 400, "batch_size": 2, "gap": 100, "until": 2}
    assert prov["data_files"][0]["folder"] == "corpus" and prov["corpus"]["files"] == []
    from train.card import data_section, read_provenance, recipe_section

    card = read_provenance(out / "checkpoint")
    assert f"| corpus | `a.txt` | {(corpus / 'a.txt').stat().st_size:,} | `{prov['data_files'][0]['sha256']}` |" in (
        data_section(card))
    assert "| 0 | 400 | 2 | 100 | 2 |" in recipe_section(card) and "--curriculum 400x2@100:2,500x2" in (
        recipe_section(card))
    assert train_main([str(corpus), "--out", str(tmp_path / "bad"), "--max-steps", "1",
                       "--curriculum", "100x2", *TINY]) == 2  # a window that cannot hold a document
