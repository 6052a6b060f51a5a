"""`reformer import-hf` on checkpoints transformers saves in the test (random weights, no download)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from export import load_artifact
from export.cli import import_hf_main
from export.hf_import import HFImportError, check_weights_file, import_hf, read_hf_checkpoint
from model import ByteTokenizer


def hf_model(vocab_size: int = 258) -> object:
    cfg = transformers.ReformerConfig(
        vocab_size=vocab_size, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        attn_layers=["local", "lsh", "local"], feed_forward_size=64, lsh_attn_chunk_length=8,
        local_attn_chunk_length=16, num_hashes=2, num_buckets=4, axial_pos_shape=(32, 64),
        axial_pos_embds_dim=(16, 16), max_position_embeddings=2048, is_decoder=True, hash_seed=None,
        hidden_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
        initializer_range=0.3, axial_norm_std=0.5, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.ReformerModelWithLMHead(cfg).eval()


def save_hf(directory: Path, fmt: str, vocab_size: int = 258) -> object:
    model = hf_model(vocab_size)
    model.save_pretrained(str(directory))  # type: ignore[attr-defined]
    if fmt == "bin":
        # transformers 5 only writes safetensors; a .bin checkpoint is its state dict saved by torch
        (directory / "model.safetensors").unlink()
        torch.save(model.state_dict(), directory / "pytorch_model.bin")  # type: ignore[attr-defined]
    return model


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_import_hf_gives_transformers_logits(tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    reference = save_hf(tmp_path / "hf", fmt)
    out = tmp_path / "art"
    assert import_hf_main([str(tmp_path / "hf"), str(out), "--no-onnx"]) == 0
    assert "logits parity with transformers: max abs diff" in capsys.readouterr().out
    art = load_artifact(out)
    assert art.tokenizer == ByteTokenizer(eos_id=2)
    assert art.config.hash_seed == 0  # unset in the checkpoint: fixed so that serving is deterministic
    parity = art.manifest["evaluation"]["transformers_parity"]
    assert parity["checked"] and parity["max_abs_diff"] <= 1e-4
    weights = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    assert set(art.manifest["provenance"]["files"]) == {"config.json", weights}
    # an independent check: the same rotations (seed 0) in the reference give the artifact's logits
    reference.config.hash_seed = 0  # type: ignore[attr-defined]
    for layer in reference.reformer.encoder.layers:  # type: ignore[attr-defined]
        layer.attention.self_attention.hash_seed = 0
    ids = torch.randint(0, 258, (2, 37))
    with torch.no_grad():
        ref = reference(ids, use_cache=False).logits  # type: ignore[operator]
        got = art.model(ids).logits
    assert (ref - got).abs().max() <= 1e-4


def test_a_non_byte_level_vocabulary_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    save_hf(tmp_path / "hf320", "safetensors", vocab_size=320)
    with pytest.raises(HFImportError, match="vocab_size 320 is not byte-level .258. and there is no tokenizer"):
        import_hf(tmp_path / "hf320", tmp_path / "art320", onnx=False)
    assert not (tmp_path / "art320").exists()


def test_bin_checkpoint_is_read_without_unpickling_code(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    save_hf(d, "bin")

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("unpickled",))

    torch.save({"x": Payload()}, d / "pytorch_model.bin")
    with pytest.raises(HFImportError, match=r"pytorch_model\.bin: cannot be loaded as a weights-only"):
        read_hf_checkpoint(d)


def test_missing_files_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "hf"
    save_hf(d, "safetensors")
    (d / "model.safetensors").unlink()
    assert import_hf_main([str(d), str(tmp_path / "art"), "--no-onnx"]) == 1
    assert "neither model.safetensors nor pytorch_model.bin" in capsys.readouterr().err
    (d / "config.json").unlink()
    assert import_hf_main([str(d), str(tmp_path / "art"), "--no-onnx"]) == 1
    assert "config.json: missing" in capsys.readouterr().err


def test_checkpoint_of_another_model_type_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    save_hf(d, "safetensors")
    config = json.loads((d / "config.json").read_text())
    config["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match="model_type is 'gpt2'"):
        read_hf_checkpoint(d)


def test_without_transformers_import_fails_unless_parity_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    save_hf(tmp_path / "hf", "safetensors")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    out = tmp_path / "art"
    assert import_hf_main([str(tmp_path / "hf"), str(out), "--no-onnx"]) == 1
    err = capsys.readouterr().err
    assert "transformers" in err and "--skip-parity" in err
    assert not out.exists() or not any(out.iterdir())  # nothing unchecked was written
    assert import_hf_main([str(tmp_path / "hf"), str(out), "--no-onnx", "--skip-parity"]) == 0
    assert "NOT checked" in capsys.readouterr().err
    parity = load_artifact(out).manifest["evaluation"]["transformers_parity"]
    assert parity == {"checked": False, "reason": "skipped (--skip-parity)"}


def test_truncated_weights_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "hf"
    save_hf(d, "safetensors")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert import_hf_main([str(d), str(tmp_path / "art"), "--no-onnx"]) == 1
    assert "model.safetensors: cannot be read as safetensors" in capsys.readouterr().err
    assert not (tmp_path / "art").exists()


def test_weights_with_nan_bytes_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    save_hf(d, "safetensors")
    weights = d / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = b"\xff" * 64  # the last tensor's last 16 float32s become NaN: the file still parses
    weights.write_bytes(bytes(data))
    with pytest.raises(HFImportError, match=r"tensor '[^']+' holds 16 NaN or infinite values .* the file is damaged"):
        import_hf(d, tmp_path / "art", onnx=False, skip_parity=True)


def test_hub_cache_copy_is_checked_against_its_blob_name(tmp_path: Path) -> None:
    """A download (huggingface_hub cache: the snapshot links to blobs/<sha256>) whose bytes no longer hash to
    the name is refused even when the damage is finite values that the logits check cannot see."""
    src = tmp_path / "saved"
    save_hf(src, "safetensors")
    data = bytearray((src / "model.safetensors").read_bytes())
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    blob = blobs / hashlib.sha256(data).hexdigest()
    (snapshot / "config.json").write_text((src / "config.json").read_text())
    (snapshot / "model.safetensors").symlink_to(blob)
    blob.write_bytes(bytes(data))
    config, state, weights = read_hf_checkpoint(snapshot)
    assert check_weights_file(weights, state) == blob.name  # intact: accepted
    data[-3] ^= 0x01  # a low mantissa bit of the last float32: finite, parses, loads
    blob.write_bytes(bytes(data))
    config, state, weights = read_hf_checkpoint(snapshot)
    with pytest.raises(HFImportError, match="altered or incompletely downloaded"):
        check_weights_file(weights, state)
