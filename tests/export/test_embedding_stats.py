"""Embedding statistics in the artifact: computed by `reformer export` from training heads only (mean, std and
the shrinkage-whitening matrix), listed and hashed in the manifest, refused at load when damaged, optional for
loading, and files without the whitening matrix (older exports) still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from export import ArtifactError, load_artifact
from export.artifact import file_sha256
from export.cli import export_main, verify_main
from export.embedding_stats import (
    FALLBACK_SHRINKAGE,
    SHRINKAGE_GRID,
    STATS_FILE,
    compute_embedding_stats,
    nn_accuracy,
    select_shrinkage,
    selection_split,
    training_passages,
    write_embedding_stats,
)
from model import ByteTokenizer
from model.pooling import EmbeddingStats, standardize, whitening_matrix
from tests.conftest import tiny_model
from tests.export.helpers import write_checkpoint

PASSAGE = 64


def _books(directory: Path) -> Path:
    """Two documents whose validation tail (the last 5% of 2,000 tokens, the reader's final newline included)
    is made of a byte ('#') that appears nowhere in their heads."""
    directory.mkdir()
    for name, letters in (("a.txt", "abc de"), ("b.txt", "xyz uv")):
        head = "".join(letters[(i * 7) % len(letters)] for i in range(1900))
        (directory / name).write_text(head + "#" * 99)
    return directory


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("stats")
    data = _books(tmp / "data")
    ckpt = write_checkpoint(tmp / "ckpt", seed=2)
    out = tmp / "art"
    assert export_main([str(ckpt), str(out), "--no-onnx", "--eval-data", str(data),
                        "--embed-stats-passages", "8", "--embed-stats-bytes", str(PASSAGE)]) == 0
    return out, data


def test_training_passages_never_touch_the_validation_tail(tmp_path: Path) -> None:
    data = _books(tmp_path / "data")
    tok = ByteTokenizer()
    cut = training_passages([data], tok, 0.05, length=PASSAGE, count=7)
    assert [name for name, _ in cut].count("a.txt") == 4 and [name for name, _ in cut].count("b.txt") == 3
    hash_id = tok.encode("#")[0]
    assert all(len(ids) == PASSAGE and hash_id not in ids for _, ids in cut)
    # spread over the whole head: the last passage of a book ends at the head's end
    head_a = np.asarray(tok.encode((data / "a.txt").read_text()))[:1900]
    assert np.array_equal(cut[3][1], head_a[-PASSAGE:]) and np.array_equal(cut[0][1], head_a[:PASSAGE])


def test_export_ships_the_stats_hashed_and_described(exported: tuple[Path, Path]) -> None:
    out, data = exported
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["files"][STATS_FILE]
    assert entry["sha256"] == file_sha256(out / STATS_FILE) and entry["size"] == (out / STATS_FILE).stat().st_size
    record = manifest["export"]["embedding_stats"]
    assert record["passages"] == 8 and record["passage_bytes"] == PASSAGE and record["bytes"] == 8 * PASSAGE
    assert record["source_files"] == ["a.txt", "b.txt"] and record["val_fraction"] == 0.05
    # chosen on the training passages: the last of each book's four held out, the other six fitted
    shrinkage = record["whitening_shrinkage"]
    selection = record["shrinkage_selection"]
    assert shrinkage in SHRINKAGE_GRID and selection["fit_passages"] == 6 and selection["held_out_passages"] == 2
    assert set(selection["held_out_accuracy"]) == {f"{s:g}" for s in SHRINKAGE_GRID}
    assert f"{1 - shrinkage:g} C + {shrinkage:g} mean(diag C) I" in record["what"]
    art = load_artifact(out)
    assert art.embedding_stats is not None and art.embedding_stats.method == "whitening"
    expected = compute_embedding_stats(tiny_model(seed=2), training_passages([data], ByteTokenizer(), 0.05, PASSAGE, 8),
                                       shrinkage)
    assert torch.allclose(art.embedding_stats.mean, expected.mean, atol=1e-6)
    assert torch.allclose(art.embedding_stats.std, expected.std, atol=1e-6)
    dim = 2 * art.config.hidden_size
    assert art.embedding_stats.mean.shape == (dim,)
    w, w_expected = art.embedding_stats.whitening, expected.whitening
    assert w is not None and w_expected is not None and w.shape == (dim, dim) and w.dtype == torch.float32
    # W W^T = C_s^-1 does not depend on the eigenvectors' signs, which may differ between two eigh calls
    assert torch.allclose(w.double() @ w.double().T, w_expected.double() @ w_expected.double().T, rtol=1e-3, atol=1e-3)


def test_export_without_training_data_skips_the_stats_and_says_so(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    assert export_main([str(ckpt), str(tmp_path / "art"), "--no-onnx"]) == 0
    art = load_artifact(tmp_path / "art")
    assert art.embedding_stats is None and STATS_FILE not in art.manifest["files"]
    assert not (tmp_path / "art" / STATS_FILE).exists()
    assert "no training data" in art.manifest["export"]["embedding_stats"]["skipped"]
    data = _books(tmp_path / "data")
    assert export_main([str(ckpt), str(tmp_path / "art0"), "--no-onnx", "--eval-data", str(data),
                        "--embed-stats-passages", "0"]) == 0
    art = load_artifact(tmp_path / "art0")
    assert art.embedding_stats is None and "turned off" in art.manifest["export"]["embedding_stats"]["skipped"]


def test_an_artifact_without_the_stats_still_loads(tiny_artifact: Path) -> None:
    assert load_artifact(tiny_artifact).embedding_stats is None


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def _rehash(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    p = directory / STATS_FILE
    manifest["files"][STATS_FILE] = {"sha256": file_sha256(p), "size": p.stat().st_size}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_an_altered_stats_file_is_refused(exported: tuple[Path, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    art = _copy(exported[0], tmp_path)
    blob = bytearray((art / STATS_FILE).read_bytes())
    blob[-3] ^= 0x01
    (art / STATS_FILE).write_bytes(bytes(blob))
    with pytest.raises(ArtifactError, match=r"embedding_stats\.safetensors: altered"):
        load_artifact(art)
    assert verify_main([str(art)]) == 1 and "embedding_stats.safetensors" in capsys.readouterr().err
    (art / STATS_FILE).unlink()
    with pytest.raises(ArtifactError, match=r"embedding_stats\.safetensors: missing"):
        load_artifact(art)


def test_a_stats_file_without_whitening_still_loads_and_standardises_per_dimension(
        exported: tuple[Path, Path], tmp_path: Path) -> None:
    art = _copy(exported[0], tmp_path)
    old = load_artifact(art).embedding_stats
    assert old is not None
    write_embedding_stats(art / STATS_FILE, EmbeddingStats(mean=old.mean, std=old.std))  # the format before W
    _rehash(art)
    stats = load_artifact(art).embedding_stats
    assert stats is not None and stats.whitening is None and stats.method == "per-dimension"
    assert torch.equal(stats.mean, old.mean) and torch.equal(stats.std, old.std)


_W = whitening_matrix(torch.randn(100, 64, generator=torch.Generator().manual_seed(0)), 0.1)


@pytest.mark.parametrize("whitening, message", [
    (_W[:, :32], r"tensor 'whitening' is torch.float32 \(64, 32\), expected float32 \(64, 64\)"),
    (torch.ones(64), r"tensor 'whitening' is torch.float32 \(64,\), expected float32 \(64, 64\)"),
    (_W.double(), r"tensor 'whitening' is torch.float64 \(64, 64\), expected float32"),
    (_W.index_fill(0, torch.tensor([3]), float("nan")), "tensor 'whitening' has non-finite values"),
    (_W.index_fill(1, torch.tensor([0]), float("inf")), "tensor 'whitening' has non-finite values"),
])
def test_a_malformed_whitening_matrix_is_refused(exported: tuple[Path, Path], tmp_path: Path,
                                                 whitening: torch.Tensor, message: str) -> None:
    art = _copy(exported[0], tmp_path)
    save_file({"mean": torch.zeros(64), "std": torch.ones(64), "whitening": whitening.contiguous()},
              str(art / STATS_FILE))
    _rehash(art)  # the manifest agrees: only the content check can catch it
    with pytest.raises(ArtifactError, match=r"embedding_stats\.safetensors: " + message):
        load_artifact(art)


@pytest.mark.parametrize("tensors, message", [
    ({"mean": torch.zeros(5), "std": torch.ones(5)},
     r"tensor 'mean' is torch.float32 \(5,\), expected float32 \(64,\)"),
    ({"mean": torch.zeros(64)}, "no tensor 'std'"),
    ({"mean": torch.zeros(64), "std": torch.zeros(64)}, "'std' has values <= 0"),
    ({"mean": torch.full((64,), float("nan")), "std": torch.ones(64)}, "'mean' has non-finite"),
])
def test_stats_that_do_not_fit_the_model_are_refused(exported: tuple[Path, Path], tmp_path: Path,
                                                     tensors: dict[str, torch.Tensor], message: str) -> None:
    art = _copy(exported[0], tmp_path)
    save_file(tensors, str(art / STATS_FILE))
    _rehash(art)  # the manifest agrees: only the content check can catch it
    with pytest.raises(ArtifactError, match=r"embedding_stats\.safetensors: .*" + message):
        load_artifact(art)
    (art / STATS_FILE).write_bytes(b"not safetensors")
    _rehash(art)
    with pytest.raises(ArtifactError, match=r"embedding_stats\.safetensors: cannot be read"):
        load_artifact(art)


def test_the_selection_holds_out_the_last_fifth_of_each_document() -> None:
    names = ["a"] * 5 + ["b"] + ["c"] * 10
    held = selection_split(names)
    assert [i for i, h in enumerate(held) if h] == [4, 14, 15]  # a: its last one; b: none (one passage); c: two


def _nuisance_vectors(n: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """Two labels told apart by a small offset along dimension 0, and a large shared random component along
    dimensions 1-3 that dominates raw cosine similarity: whitening (small shrinkage) separates them, the
    centring alone (shrinkage 1) does not."""
    g = torch.Generator().manual_seed(seed)
    labels = ["x" if i % 2 == 0 else "y" for i in range(n)]
    v = torch.randn(n, 8, generator=g) * 0.01
    v[:, 0] += torch.tensor([0.05 if name == "x" else -0.05 for name in labels])
    v[:, 1:4] += torch.randn(n, 3, generator=g) * 10.0
    return v, labels


def test_the_shrinkage_that_identifies_held_out_passages_best_is_chosen() -> None:
    v, labels = _nuisance_vectors(200, seed=0)
    choice = select_shrinkage(v, labels)
    scores = choice.record["held_out_accuracy"]
    assert choice.shrinkage < 1.0 and scores[f"{choice.shrinkage:g}"] == max(a for a in scores.values() if a)
    assert scores["1"] < 0.8 < scores[f"{choice.shrinkage:g}"]
    # the same figures as whitening by hand with the fitting passages' statistics
    held = selection_split(labels)
    fit, test = v[[not h for h in held]], v[held]
    by_hand = nn_accuracy(standardize(test, EmbeddingStats.from_vectors(fit, choice.shrinkage)),
                          [n for n, h in zip(labels, held) if h])
    assert round(by_hand, 4) == scores[f"{choice.shrinkage:g}"]
    assert choice.record["fit_passages"] == 160 and choice.record["held_out_passages"] == 40


def test_ties_go_to_the_larger_shrinkage_and_too_few_passages_fall_back() -> None:
    g = torch.Generator().manual_seed(1)
    labels = ["x" if i % 2 == 0 else "y" for i in range(40)]
    # far-apart labels: the larger shrinkages identify every held-out passage (the smallest also blow up the
    # noise dimensions)
    v = torch.randn(40, 4, generator=g) * 0.01 + torch.tensor([[5.0, 0, 0, 0] if n == "x" else [0, 5.0, 0, 0]
                                                                for n in labels])
    choice = select_shrinkage(v, labels)
    scores = choice.record["held_out_accuracy"]
    winners = [s for s in SHRINKAGE_GRID if scores[f"{s:g}"] == 1.0]
    assert len(winners) >= 2 and choice.shrinkage == max(winners) == max(SHRINKAGE_GRID)
    one_book = select_shrinkage(v, ["x"] * 40)
    assert one_book.shrinkage == FALLBACK_SHRINKAGE and "too few" in one_book.record["rule"]


def test_a_given_shrinkage_is_used_and_recorded_and_a_bad_one_refused(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = _books(tmp_path / "data")
    ckpt = write_checkpoint(tmp_path / "ckpt", seed=2)
    base = [str(ckpt), "--no-onnx", "--eval-data", str(data), "--embed-stats-passages", "8",
            "--embed-stats-bytes", str(PASSAGE)]
    assert export_main([base[0], str(tmp_path / "art"), *base[1:], "--embed-stats-shrinkage", "0.3"]) == 0
    record = load_artifact(tmp_path / "art").manifest["export"]["embedding_stats"]
    assert record["whitening_shrinkage"] == 0.3 and record["shrinkage_selection"] == {"rule": "given (0.3)"}
    assert export_main([base[0], str(tmp_path / "bad"), *base[1:], "--embed-stats-shrinkage", "1.5"]) == 1
    assert "shrinkage must be in [0, 1], got 1.5" in capsys.readouterr().err


def test_export_reads_several_eval_data_folders(tmp_path: Path) -> None:
    first, second = _books(tmp_path / "one"), tmp_path / "two"
    second.mkdir()
    (second / "c.txt").write_text("".join("pqr st"[(i * 5) % 6] for i in range(1900)) + "#" * 99)
    ckpt = write_checkpoint(tmp_path / "ckpt", seed=2)
    assert export_main([str(ckpt), str(tmp_path / "art"), "--no-onnx", "--eval-data", str(first), str(second),
                        "--embed-stats-passages", "12", "--embed-stats-bytes", str(PASSAGE)]) == 0
    record = load_artifact(tmp_path / "art").manifest["export"]["embedding_stats"]
    assert {Path(f).name for f in record["source_files"]} == {"a.txt", "b.txt", "c.txt"}
