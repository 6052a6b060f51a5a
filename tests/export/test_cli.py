"""`reformer export` from a training checkpoint, and `reformer verify` on what it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from export import load_artifact
from export.checkpoint import CheckpointError, read_checkpoint_weights
from export.cli import export_main, verify_main
from tests.conftest import tiny_model
from tests.export.helpers import write_checkpoint


def test_read_checkpoint_weights_returns_config_state_and_metadata(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt")
    config, state, metadata = read_checkpoint_weights(ckpt)
    assert config.to_dict() == tiny_model().config.to_dict()
    assert torch.equal(state["lm_head.weight"], tiny_model().lm_head.weight)
    assert metadata["provenance"]["steps"] == 12
    assert metadata["evaluation"] == {"val_bits_per_byte": 7.9}


def test_checkpoint_without_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    save_file({"x": torch.zeros(2)}, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: safetensors metadata has no 'config'"):
        read_checkpoint_weights(tmp_path / "ckpt")


def test_export_command_writes_an_artifact_with_the_checkpoint_records(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", seed=4)
    out = tmp_path / "art"
    assert export_main([str(ckpt), str(out), "--no-onnx"]) == 0
    assert "artifact written to" in capsys.readouterr().out
    art = load_artifact(out)
    ids = torch.randint(2, 258, (1, 30))
    with torch.no_grad():
        assert torch.equal(art.model(ids).logits, tiny_model(seed=4)(ids).logits)
    prov = art.manifest["provenance"]
    assert prov["steps"] == 12 and prov["seed"] == 3 and prov["data"] == {"books.txt": "ab" * 32}
    assert prov["command"] == "reformer train books.txt --out run"
    assert prov["checkpoint"]["sha256"] and prov["export_command"].startswith("reformer export ")
    assert prov["code_version"]
    assert art.manifest["evaluation"]["val_bits_per_byte"] == 7.9
    assert verify_main([str(out)]) == 0
    assert "no ONNX graph" in capsys.readouterr().out


def test_export_command_reports_errors_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    assert export_main([str(tmp_path / "missing"), str(tmp_path / "art"), "--no-onnx"]) == 1
    assert "no such checkpoint" in capsys.readouterr().err
    ckpt = write_checkpoint(tmp_path / "ckpt")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    assert export_main([str(ckpt), str(tmp_path / "taken"), "--no-onnx"]) == 1
    assert "not empty" in capsys.readouterr().err
    assert export_main([str(ckpt), str(tmp_path / "q"), "--no-onnx", "--quantize", "int8"]) == 1
    assert "cannot be combined" in capsys.readouterr().err


def test_export_refuses_weights_that_disagree_with_the_config(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_model()
    (tmp_path / "ckpt").mkdir()
    cfg = model.config.to_dict() | {"hidden_size": 48, "axial_pos_embds_dim": [24, 24]}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "ckpt" / "model.safetensors"),
              metadata={"config": json.dumps(cfg)})
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "art"), "--no-onnx"]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "has shape" in err
    assert not (tmp_path / "art").exists()


def test_verify_command_names_a_tampered_file(tiny_artifact: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    d = tmp_path / "copy"
    shutil.copytree(tiny_artifact, d)
    description = d / "reformer_tokenizer.json"
    description.write_text(description.read_text().replace('"eos_id": 1', '"eos_id": 2'))
    assert verify_main([str(d)]) == 1
    assert "reformer_tokenizer.json: altered" in capsys.readouterr().err


def test_random_default_refuses_to_replace_the_packaged_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from export import random_default

    shipped = tmp_path / "default_artifact"  # stands in for the packaged directory, which must stay untouched
    shipped.mkdir()
    (shipped / "model.safetensors").write_bytes(b"trained weights")
    monkeypatch.setattr(random_default, "DEFAULT_ARTIFACT", shipped)
    monkeypatch.setattr(random_default.sys, "argv", ["random_default"])
    with pytest.raises(SystemExit) as exit_info:  # no OUT_DIR: nothing is written to a default place
        random_default.main()
    assert exit_info.value.code == 2
    assert random_default.main([str(shipped)]) == 2
    err = capsys.readouterr().err
    assert "default artifact" in err and "--force" in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    assert random_default.main([str(other)]) == 2
    assert (shipped / "model.safetensors").read_bytes() == b"trained weights"
    assert [p.name for p in shipped.iterdir()] == ["model.safetensors"]
    assert (other / "keep.txt").read_text() == "x"
