"""bench/long_context.py, quality/embed_quality.py and val_bpb.py on a tiny checkpoint and a tiny corpus made here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from export.embedding_stats import SHRINKAGE_GRID
from model import ReformerConfig, ReformerLM
from train.checkpoint import TrainerState, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# the scripts import as their command line runs them: each from its own folder
for folder in ("bench", "bench/quality", "bench/training"):
    sys.path.insert(0, str(ROOT / folder))

import embed_quality  # noqa: E402
import long_context  # noqa: E402
import val_bpb  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("after")
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name, letters in (("aaa", "abcde fgh\n"), ("bbb", "pqrstu vw\n"), ("ccc", "KLMNOP QR\n")):
        (data / f"{name}.txt").write_text("".join(rng.choice(list(letters), size=2000)))
    torch.manual_seed(0)
    cfg = ReformerConfig(hidden_size=32, num_attention_heads=2, attention_head_size=16,
                         attn_layers=["local", "lsh"], feed_forward_size=64, lsh_attn_chunk_length=16,
                         local_attn_chunk_length=16, num_hashes=2, num_buckets=4, axial_pos_shape=(16, 64),
                         axial_pos_embds_dim=(16, 16), max_position_embeddings=1024, initializer_range=0.1,
                         axial_norm_std=0.02)
    lm = ReformerLM(cfg)
    opt = torch.optim.AdamW(lm.parameters())
    ckpt = save_checkpoint(root / "checkpoint", lm, opt, TrainerState(), {}, {}, {})
    return ckpt, data


def test_long_context_scores_the_same_bytes_both_ways(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, data = tiny
    out = tmp_path / "lc.json"
    # val fraction 0.5: 1000-byte tails -> 3 passages of 256 per book
    assert long_context.main([str(ckpt), "--data", str(data), "--val-fraction", "0.5", "--passage", "256",
                              "--tail", "64", "--context", "64", "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    total = res["rows"][-1]
    assert total["book"] == "all" and total["passages"] == 9 and total["bytes_scored"] == 9 * 64
    assert {r["book"] for r in res["rows"][:-1]} == {"aaa.txt", "bbb.txt", "ccc.txt"}
    assert 0 < total["bpb_full_context"] < 16 and total["bpb_full_context"] != total["bpb_short_context"]
    # the control gives the short context at the passage's positions: other position embeddings, other bits
    control = total["bpb_short_context_same_positions"]
    assert control not in (total["bpb_full_context"], total["bpb_short_context"])
    # with no more context than the short case, both figures are the same computation
    same = tmp_path / "same.json"
    long_context.main([str(ckpt), "--data", str(data), "--val-fraction", "0.5", "--passage", "128", "--tail", "64",
                       "--context", "64", "--threads", "1", "--out", str(same)])
    row = json.loads(same.read_text())["rows"][-1]
    assert row["bpb_full_context"] == pytest.approx(row["bpb_short_context"], abs=1e-4)
    assert row["bpb_short_context_same_positions"] == row["bpb_short_context"]  # offset 0: the same input


def test_embed_quality_reports_every_pooling_against_bag_of_bytes(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, data = tiny
    out = tmp_path / "eq.json"
    assert embed_quality.main([str(ckpt), "--data", str(data), "--val-fraction", "0.5", "--passage", "100",
                               "--per-book", "6", "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["passages"] == 18 and res["per_book"] == {"aaa.txt": 6, "bbb.txt": 6, "ccc.txt": 6}
    pools = [r["pooling"] for r in res["rows"]]
    raw = ["final-mean", "final-last", "layer0-mean", "layer1-mean"]
    assert pools == ["bag-of-bytes (baseline)", *raw, *(f"{p} standardised" for p in raw), "final-mean whitened"]
    # standardised and whitened with training-head passages: the default 3000 capped at the 10 non-overlapping
    # passages of 100 bytes a 1,000-byte head holds
    assert res["stats_passages"] == 30 and res["stats_per_book"] == {"aaa.txt": 10, "bbb.txt": 10, "ccc.txt": 10}
    assert res["artifact_stats"] is False and res["served_method"] is None  # a checkpoint ships none: no "served" row
    # the shrinkage chosen on those training passages, as `reformer export` chooses it
    assert res["whitening_shrinkage"] in SHRINKAGE_GRID and res["shrinkage_selection"]["held_out_passages"] == 6
    # the three books use disjoint letters: counting bytes identifies every passage
    assert res["rows"][0]["accuracy"] == 1.0
    assert res["best_pooling"] in pools[1:]


def test_embed_quality_measures_an_artifact_as_served(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from export.cli import export_main

    ckpt, data = tiny
    art = tmp_path / "art"
    assert export_main([str(ckpt), str(art), "--no-onnx", "--eval-data", str(data), "--embed-stats-bytes", "100",
                        "--embed-stats-passages", "9"]) == 0
    out = tmp_path / "eq.json"
    assert embed_quality.main([str(art), "--data", str(data), "--passage", "100", "--per-book", "6",
                               "--stats-passages", "9", "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["pooling"]: r["accuracy"] for r in res["rows"]}
    assert res["artifact_stats"] is True and res["served_method"] == "whitening"
    # export and bench pick the same training passages and pool alike: the served row is the bench's own
    # whitened final mean
    assert rows["served (artifact stats)"] == rows["final-mean whitened"]


def test_nearest_neighbour_accuracy_counts_only_other_passages() -> None:
    v = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    assert embed_quality.nn_accuracy(v, ["a", "a", "b", "b"]) == 1.0
    assert embed_quality.nn_accuracy(v, ["a", "b", "a", "b"]) == 0.0


def test_plot_training_draws_a_curve_file(tmp_path: Path) -> None:
    import plot_training

    run = tmp_path / "run"
    run.mkdir()
    (run / "curve.csv").write_text("step,phase,tokens_seen,wall_time_s,val_bpb,val_bytes,train_loss\n"
                                   "10,0,81920,60.0,3.9,16000,2.7\n20,1,245760,130.0,3.5,16000,2.4\n")
    out = tmp_path / "curves.png"
    assert plot_training.main([str(run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_training.main([str(tmp_path / "missing"), "--out", str(out)]) == 2


def test_plot_training_draws_the_recipes_retrieval_panels_only_when_the_curve_has_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import plot_training

    drawn: list[int] = []
    real = plot_training._plot_retrieval
    monkeypatch.setattr(plot_training, "_plot_retrieval", lambda runs, axes: (drawn.append(len(axes)),
                                                                            real(runs, axes)))
    plain, recipe = tmp_path / "plain.csv", tmp_path / "recipe.csv"
    plain.write_text("step,phase,tokens_seen,wall_time_s,val_bpb\n10,0,8192,6.0,3.9\n")
    recipe.write_text("step,phase,tokens_seen,wall_time_s,val_bpb,train_passkey_loss,val_passkey_loss,"
                      "val_passkey_acc\n0,0,0,0.0,2.2,,8.4,0.0\n100,0,409600,60.0,2.5,2.3,2.2,0.25\n")
    assert plot_training.main([str(plain), "--out", str(tmp_path / "a.png")]) == 0
    assert drawn == []
    assert plot_training.main([str(recipe), "--out", str(tmp_path / "b.png")]) == 0
    assert drawn == [2]  # the lower row: answer loss, held-out accuracy


def test_plot_training_chains_fine_tunes_from_where_the_run_before_ended(tmp_path: Path) -> None:
    import plot_training

    first = [{"tokens_seen": 100.0, "wall_time_s": 10.0, "val_bpb": 3.0},
             {"tokens_seen": 200.0, "wall_time_s": 30.0, "val_bpb": 2.5}]
    second = [{"tokens_seen": 50.0, "wall_time_s": 5.0, "val_bpb": 2.4}]
    (a, rows_a), (b, rows_b) = plot_training.chained([("a", first), ("b", second)])
    assert rows_a == first and (a, b) == ("a", "b")
    assert rows_b == [{"tokens_seen": 250.0, "wall_time_s": 35.0, "val_bpb": 2.4}]
    run = tmp_path / "run.csv"
    run.write_text("step,phase,tokens_seen,wall_time_s,val_bpb,val_bytes,train_loss\n10,0,81920,60.0,3.9,16000,2.7\n")
    out = tmp_path / "chain.png"
    assert plot_training.main([str(run), str(run), "--chain", "--out", str(out)]) == 0
    assert out.exists()


def test_val_bpb_scores_every_held_out_byte_per_folder(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, data = tiny
    other = tmp_path / "other"
    other.mkdir()
    (other / "ddd.txt").write_text("xyz " * 500)
    out = tmp_path / "v.json"
    assert val_bpb.main([str(ckpt), "--data", str(data), str(other), "--val-fraction", "0.5", "--window", "300",
                         "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    first, second = res["groups"]
    # 1,000-byte tails in windows of 300: 4 windows, each scoring all but its first byte
    assert [f["bytes"] for f in first["files"]] == [996, 996, 996] and first["bytes"] == 3 * 996
    assert [f["file"] for f in second["files"]] == ["ddd.txt"]
    lm, _ = val_bpb.load_lm(ckpt)
    bits, scored = val_bpb.tail_bits(lm, np.arange(300, dtype=np.int64) % 250 + 2, 300)
    assert scored == 299 and 0 < bits / scored < 16
    expected = sum(f["bits_per_byte"] * f["bytes"] for f in first["files"]) / first["bytes"]
    assert first["bits_per_byte"] == pytest.approx(expected, abs=1e-4)
