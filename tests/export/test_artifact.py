"""Artifact round trip and refusal of anything that does not match its manifest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from export import ArtifactError, load_artifact, save_artifact
from export.artifact import file_sha256
from model import ByteTokenizer
from tests.conftest import tiny_model


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def _rehash(directory: Path, name: str) -> None:
    """Make the manifest agree with a file again, so only the deeper check can catch the change."""
    manifest = json.loads((directory / "manifest.json").read_text())
    p = directory / name
    manifest["files"][name] = {"sha256": file_sha256(p), "size": p.stat().st_size}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_round_trip_gives_the_same_model(tiny_artifact: Path) -> None:
    art = load_artifact(tiny_artifact)
    reference = tiny_model()
    ids = torch.randint(2, 258, (2, 21))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    with torch.no_grad():
        assert torch.equal(art.model(ids, mask).logits, reference(ids, mask).logits)
    assert not art.model.training
    assert art.config.to_dict() == reference.config.to_dict()
    assert art.config.hash_seed == 0
    assert art.tokenizer == ByteTokenizer()
    assert art.sha256 == file_sha256(tiny_artifact / "model.safetensors")
    assert art.onnx_path is None
    files = art.manifest["files"]
    assert set(files) == {"config.json", "model.safetensors", "tokenizer.json", "reformer_tokenizer.json"}
    assert all(files[n]["size"] == (tiny_artifact / n).stat().st_size for n in files)
    assert art.manifest["format_version"] == 1
    assert art.manifest["provenance"]["note"] == "random weights for tests"
    assert "code_version" in art.manifest["provenance"]


def test_save_refuses_a_non_empty_directory_unless_told(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        save_artifact(tiny_model(), tmp_path / "a", onnx=False)
    save_artifact(tiny_model(seed=1), tmp_path / "a", onnx=False, overwrite=True)
    assert not (tmp_path / "a" / "keep.txt").exists()
    assert load_artifact(tmp_path / "a").config.hidden_size == 32


def test_altered_byte_is_refused(tiny_artifact: Path, tmp_path: Path) -> None:
    d = _copy(tiny_artifact, tmp_path)
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-5] ^= 0x01
    (d / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"model\.safetensors: altered"):
        load_artifact(d)


def test_truncated_file_is_refused(tiny_artifact: Path, tmp_path: Path) -> None:
    d = _copy(tiny_artifact, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match=r"model\.safetensors: truncated"):
        load_artifact(d)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors", "manifest.json"])
def test_missing_file_is_refused(tiny_artifact: Path, tmp_path: Path, name: str) -> None:
    d = _copy(tiny_artifact, tmp_path)
    (d / name).unlink()
    with pytest.raises(ArtifactError, match=rf"{name}: missing"):
        load_artifact(d)


def test_unknown_format_version_is_refused(tiny_artifact: Path, tmp_path: Path) -> None:
    d = _copy(tiny_artifact, tmp_path)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["format_version"] = 99
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"manifest\.json: unknown format_version 99"):
        load_artifact(d)


def test_config_that_disagrees_with_the_weights_is_refused(tiny_artifact: Path, tmp_path: Path) -> None:
    d = _copy(tiny_artifact, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config["feed_forward_size"] = 48
    (d / "config.json").write_text(json.dumps(config))
    _rehash(d, "config.json")
    with pytest.raises(ArtifactError, match=r"model\.safetensors: tensor 'layers\.0\.feed_forward\.dense\.weight'"
                                            r" has shape \(64, 32\), but config\.json implies \(48, 32\)"):
        load_artifact(d)


def test_weights_missing_a_tensor_are_refused(tiny_artifact: Path, tmp_path: Path) -> None:
    d = _copy(tiny_artifact, tmp_path)
    state = load_file(str(d / "model.safetensors"))
    del state["lm_head.bias"]
    save_file(state, str(d / "model.safetensors"))
    _rehash(d, "model.safetensors")
    with pytest.raises(ArtifactError, match=r"model\.safetensors: tensor 'lm_head\.bias'.* missing"):
        load_artifact(d)


def test_unreadable_safetensors_is_refused(tiny_artifact: Path, tmp_path: Path) -> None:
    d = _copy(tiny_artifact, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    _rehash(d, "model.safetensors")
    with pytest.raises(ArtifactError, match=r"model\.safetensors: cannot be read"):
        load_artifact(d)


def test_invalid_config_is_refused(tiny_artifact: Path, tmp_path: Path) -> None:
    d = _copy(tiny_artifact, tmp_path)
    config = json.loads((d / "config.json").read_text())
    config["attn_layers"] = ["global"]
    (d / "config.json").write_text(json.dumps(config))
    _rehash(d, "config.json")
    with pytest.raises(ArtifactError, match=r"config\.json: not a valid model configuration"):
        load_artifact(d)


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        load_artifact(tmp_path / "nowhere")


def test_same_weights_give_the_same_artifact_hash(tiny_artifact: Path, tmp_path: Path) -> None:
    again = save_artifact(tiny_model(), tmp_path / "again", onnx=False)
    assert load_artifact(again).sha256 == load_artifact(tiny_artifact).sha256
    assert (again / "config.json").read_bytes() == (tiny_artifact / "config.json").read_bytes()


def test_a_volume_roots_and_a_configmaps_folders_are_not_artifact_files(tiny_artifact: Path, tmp_path: Path) -> None:
    """An artifact at a volume's root has `lost+found`; one mounted from a ConfigMap has `..data` (a link to a
    `..<timestamp>` folder). Both were refused as unlisted files; a file of either name still is."""
    d = _copy(tiny_artifact, tmp_path)
    (d / "lost+found").mkdir()
    (d / "..2026_12_07_16_00_00.123").mkdir()
    (d / "..data").symlink_to("..2026_12_07_16_00_00.123")
    assert load_artifact(d).config.hidden_size == 32
    shutil.rmtree(d / "lost+found")
    (d / "lost+found").write_text("not a folder")
    with pytest.raises(ArtifactError, match=r"^lost\+found: in .* but not listed"):
        load_artifact(d)
    (d / "lost+found").unlink()
    (d / "..data").unlink()
    (d / "..data").write_text("a file")
    with pytest.raises(ArtifactError, match=r"^\.\.data: in .* but not listed"):
        load_artifact(d)
