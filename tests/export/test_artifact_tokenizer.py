"""The tokenizer an artifact carries: written, read back, refused when damaged or of the wrong size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFFile

from export.artifact import DEFAULT_ARTIFACT, ArtifactError, load_artifact, save_artifact, write_manifest
from model import ByteTokenizer
from model.tokenizers.files import TokenizerFileError, read_tokenizer
from tests.conftest import tiny_model
from tests.model.tokenizers.helpers import SAMPLE, sentencepiece_tokenizer


@pytest.fixture(scope="module")
def sp_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = sentencepiece_tokenizer()
    out = tmp_path_factory.mktemp("sp") / "artifact"
    save_artifact(tiny_model(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id), out, tokenizer=tok, onnx=False)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _resign(d: Path) -> None:
    """Rewrite the manifest after a change, so that loading gets past the hashes to the tokenizer checks."""
    write_manifest(d, {}, {}, {})


def test_a_sentencepiece_artifact_loads_its_tokenizer(sp_artifact: Path) -> None:
    art = load_artifact(sp_artifact)
    tok = sentencepiece_tokenizer()
    assert art.tokenizer.kind == "sentencepiece"
    assert art.tokenizer.encode(SAMPLE) == tok.encode(SAMPLE)
    assert {"tokenizer.json", "reformer_tokenizer.json", "tokenizer.model"} <= set(art.manifest["files"])
    assert HFFile.from_file(str(sp_artifact / "tokenizer.json")).encode(SAMPLE).ids == tok.encode(SAMPLE)


def test_a_corrupted_tokenizer_is_refused_with_the_files_name(sp_artifact: Path, tmp_path: Path) -> None:
    d = _copy(sp_artifact, tmp_path / "copy")
    (d / "tokenizer.model").write_bytes((d / "tokenizer.model").read_bytes()[:100])
    with pytest.raises(ArtifactError, match="tokenizer.model: truncated"):  # the manifest sees it first
        load_artifact(d)
    _resign(d)
    with pytest.raises(ArtifactError, match="^tokenizer.model: not a SentencePiece model"):
        load_artifact(d)


def test_a_tokenizer_of_the_wrong_size_is_refused(sp_artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the tokenizer has 64 ids but the model's vocab_size is 258"):
        save_artifact(tiny_model(), tmp_path / "never", tokenizer=sentencepiece_tokenizer(), onnx=False)
    assert not (tmp_path / "never").exists()
    d = _copy(sp_artifact, tmp_path / "copy")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "vocab_size": 258}))
    _resign(d)
    with pytest.raises(ArtifactError, match="^reformer_tokenizer.json: the sentencepiece tokenizer has 64 ids, "
                                            "but the model's vocab_size is 258"):
        load_artifact(d)


def test_an_older_artifact_with_the_byte_description_in_tokenizer_json_loads(tiny_artifact: Path,
                                                                             tmp_path: Path) -> None:
    d = _copy(tiny_artifact, tmp_path / "old")
    (d / "reformer_tokenizer.json").unlink()
    (d / "tokenizer.json").write_text(json.dumps(ByteTokenizer().describe(), indent=2, sort_keys=True) + "\n")
    _resign(d)
    assert load_artifact(d).tokenizer == ByteTokenizer()


def test_the_shipped_artifact_carries_a_tokenizers_file() -> None:
    from transformers import PreTrainedTokenizerFast

    art = load_artifact(DEFAULT_ARTIFACT)
    text = "naïve\x00日本 🤖"
    fast = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_ARTIFACT / "tokenizer.json"))
    assert fast(text, add_special_tokens=False)["input_ids"] == art.tokenizer.encode(text)


def test_an_older_artifact_is_upgraded_in_place(tiny_artifact: Path, tmp_path: Path) -> None:
    from export.tokenizer_upgrade import upgrade_tokenizer_files

    d = _copy(tiny_artifact, tmp_path / "old")
    (d / "reformer_tokenizer.json").unlink()
    (d / "tokenizer.json").write_text(json.dumps(ByteTokenizer(eos_id=2).describe()))
    _resign(d)
    before = json.loads((d / "manifest.json").read_text())
    assert upgrade_tokenizer_files(d) is True
    after = json.loads((d / "manifest.json").read_text())
    assert load_artifact(d).tokenizer == ByteTokenizer(eos_id=2)
    assert HFFile.from_file(str(d / "tokenizer.json")).encode("é\x00").ids == ByteTokenizer().encode("é\x00")
    assert {k: v for k, v in after.items() if k != "files"} == {k: v for k, v in before.items() if k != "files"}
    assert after["files"]["model.safetensors"] == before["files"]["model.safetensors"]
    assert upgrade_tokenizer_files(d) is False


def test_bits_per_byte_counts_bytes_whatever_the_tokenizer(sp_artifact: Path) -> None:
    from export.quantize import bits_per_byte_torch, text_ids

    text = SAMPLE.encode() * 4
    assert text_ids(text, ByteTokenizer()) == ([b + 2 for b in text], 1.0)
    tok = sentencepiece_tokenizer()
    ids, bytes_per_token = text_ids(text, tok)
    assert ids == tok.encode(text.decode()) and bytes_per_token == len(text) / len(ids) > 1
    art = load_artifact(sp_artifact)
    per_token = bits_per_byte_torch(art.model, text, tok, window=len(ids)) * bytes_per_token
    assert 0 < per_token < 2 * torch.log2(torch.tensor(float(tok.vocab_size))).item()


@pytest.mark.parametrize("unlisted", ["reformer_tokenizer.json", "tokenizer.model"])
def test_a_tokenizer_file_the_manifest_does_not_list_is_refused_by_name(sp_artifact: Path, tmp_path: Path,
                                                                        unlisted: str) -> None:
    """The loader read the description and the SentencePiece model whether or not the manifest listed (and so
    hashed) them: dropped from the manifest, either could be replaced unchecked."""
    d = _copy(sp_artifact, tmp_path / "copy")
    manifest = json.loads((d / "manifest.json").read_text())
    del manifest["files"][unlisted]
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=f"^{unlisted}: in .* but not listed in manifest.json"):
        load_artifact(d)
    with pytest.raises(TokenizerFileError, match=f"^{unlisted}: not listed in the artifact's manifest"):
        read_tokenizer(d, listed=set(manifest["files"]))


def test_any_file_the_manifest_does_not_list_is_refused_by_name(sp_artifact: Path, tmp_path: Path) -> None:
    d = _copy(sp_artifact, tmp_path / "copy")
    (d / "chat_template.jinja").write_text("{{ messages[0].content }}")  # added by hand: would be ignored
    with pytest.raises(ArtifactError, match="^chat_template.jinja: in .* but not listed in manifest.json"):
        load_artifact(d)
    _resign(d)
    assert load_artifact(d).chat_template == "{{ messages[0].content }}"


def test_the_shipped_artifact_lists_every_file_it_holds() -> None:
    manifest = json.loads((DEFAULT_ARTIFACT / "manifest.json").read_text())
    assert {p.name for p in DEFAULT_ARTIFACT.iterdir()} == {*manifest["files"], "manifest.json"}
    load_artifact()
