"""`reformer import-hf` of google/reformer-crime-and-punishment's configuration at reduced width (the same layer
pattern, factorised buckets, 524,288 axial positions) with a SentencePiece tokenizer trained in the test; and
hub ids, downloaded by a stand-in for huggingface_hub's snapshot_download (these machines reach no hub)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFFile

from bench.import_hf.import_hf_crime import CRIME_AND_PUNISHMENT
from export import load_artifact
from export.cli import import_hf_main
from export.hf_import import HFImportError, import_hf
from tests.model.tokenizers.helpers import SAMPLE, sentencepiece_model, sentencepiece_tokenizer

HUB_ID = "google/reformer-crime-and-punishment"


def reduced_config(vocab_size: int) -> dict[str, Any]:
    """Crime-and-punishment's configuration, narrower: hidden 32 (axial dims 8 + 24), 2 heads x 16, FF 64."""
    return {**CRIME_AND_PUNISHMENT, "vocab_size": vocab_size, "hidden_size": 32, "attention_head_size": 16,
            "axial_pos_embds_dim": [8, 24], "feed_forward_size": 64, "hidden_dropout_prob": 0.0,
            "local_attention_probs_dropout_prob": 0.0, "initializer_range": 0.3, "axial_norm_std": 0.5}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = sentencepiece_tokenizer()
    d = tmp_path_factory.mktemp("crime") / "ckpt"
    torch.manual_seed(8)
    transformers.ReformerModelWithLMHead(transformers.ReformerConfig(**reduced_config(tok.vocab_size))) \
        .save_pretrained(str(d))
    (d / "spiece.model").write_bytes(sentencepiece_model())
    return d


def test_the_configuration_imports_with_parity_and_its_tokenizer(checkpoint: Path, tmp_path: Path) -> None:
    out, parity = import_hf(checkpoint, tmp_path / "art", onnx=False)
    assert parity["checked"] and parity["max_abs_diff"] <= parity["tolerance"]
    art = load_artifact(out)
    cfg = art.config
    assert cfg.attn_layers == ["local", "lsh"] * 3 and cfg.num_buckets == [64, 128] and cfg.num_hashes == 1
    assert cfg.max_position_embeddings == 524288 and tuple(cfg.axial_pos_shape) == (512, 1024)
    assert (cfg.lsh_attn_chunk_length, cfg.lsh_num_chunks_before, cfg.local_attn_chunk_length) == (64, 1, 64)
    tok = sentencepiece_tokenizer()
    assert art.tokenizer.kind == "sentencepiece" and art.tokenizer.eos_id == 2
    assert art.tokenizer.encode(SAMPLE) == tok.encode(SAMPLE)
    assert HFFile.from_file(str(out / "tokenizer.json")).encode(SAMPLE).ids == tok.encode(SAMPLE)
    assert art.manifest["provenance"]["tokenizer"] == {"kind": "sentencepiece", "from": "spiece.model"}
    assert "spiece.model" in art.manifest["provenance"]["files"]


def test_a_tokenizer_that_does_not_fit_is_refused_by_name(checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(checkpoint, d)
    (d / "spiece.model").write_bytes(sentencepiece_model()[:200])
    with pytest.raises(HFImportError, match="spiece.model: not a SentencePiece model"):
        import_hf(d, tmp_path / "a", onnx=False, skip_parity=True)
    (d / "spiece.model").write_bytes(sentencepiece_model(320, byte_fallback=True))
    with pytest.raises(HFImportError, match="spiece.model: the tokenizer has 320 ids, but config.json's "
                                            "vocab_size is 64"):
        import_hf(d, tmp_path / "b", onnx=False, skip_parity=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_hub_id_is_downloaded_with_huggingface_hub(checkpoint: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    calls: list[dict[str, Any]] = []

    def fake_download(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        return str(checkpoint)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    argv = [HUB_ID, str(tmp_path / "art"), "--no-onnx", "--skip-parity", "--revision", "v1",
            "--cache-dir", str(tmp_path / "cache"), "--token", "hf_secret"]
    assert import_hf_main(argv) == 0
    assert len(calls) == 1
    call = calls[0]
    assert (call["repo_id"], call["revision"], call["cache_dir"], call["token"]) == (
        HUB_ID, "v1", tmp_path / "cache", "hf_secret")
    assert "spiece.model" in str(call["allow_patterns"]) or "*.model" in call["allow_patterns"]
    manifest_text = (tmp_path / "art" / "manifest.json").read_text()
    assert "hf_secret" not in manifest_text  # the token is a secret: never written
    provenance = json.loads(manifest_text)["provenance"]
    assert provenance["hub"]["repo_id"] == HUB_ID and provenance["hub"]["revision"] == "v1"
    assert load_artifact(tmp_path / "art").tokenizer.kind == "sentencepiece"


def test_a_local_folder_is_read_without_the_hub(checkpoint: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def no_download(*args: Any, **kwargs: Any) -> str:
        raise AssertionError("a local folder must not be downloaded")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_download)
    assert import_hf_main([str(checkpoint), str(tmp_path / "art"), "--no-onnx", "--skip-parity"]) == 0
    assert "hub" not in load_artifact(tmp_path / "art").manifest["provenance"]


def test_a_failed_download_and_a_missing_folder_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(repo_id: str, **kwargs: Any) -> str:
        raise LocalEntryNotFoundError("cannot reach the hub and nothing is cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert import_hf_main([HUB_ID, str(tmp_path / "art")]) == 1
    assert f"{HUB_ID}: not a local folder, and downloading it from the hub failed" in capsys.readouterr().err
    assert import_hf_main([str(tmp_path / "no" / "such" / "dir"), str(tmp_path / "art")]) == 1
    assert "config.json: missing" in capsys.readouterr().err


def test_a_checkpoints_tokenizers_file_is_imported_when_it_has_no_sentencepiece_model(
        checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "ckpt"
    shutil.copytree(checkpoint, d)
    (d / "spiece.model").unlink()
    sentencepiece_tokenizer().to_hf().save(str(d / "tokenizer.json"))
    out, _ = import_hf(d, tmp_path / "art", onnx=False, skip_parity=True)
    art = load_artifact(out)
    assert art.tokenizer.kind == "hf" and art.tokenizer.eos_id == 2
    assert art.tokenizer.encode(SAMPLE) == sentencepiece_tokenizer().encode(SAMPLE)
