from __future__ import annotations

import json
from pathlib import Path

import pytest

from model import ByteTokenizer
from model.tokenizer import Tokenizer
from model.tokenizers.files import (
    DESCRIPTION_FILE,
    HF_FILE,
    SENTENCEPIECE_FILE,
    TokenizerFileError,
    read_tokenizer,
    write_tokenizer_files,
)
from model.tokenizers.hf_tokenizer import HFTokenizer

from .helpers import SAMPLE, sentencepiece_tokenizer


def _kinds() -> dict[str, Tokenizer]:
    sp = sentencepiece_tokenizer()
    return {"byte": ByteTokenizer(eos_id=2), "sentencepiece": sp,
            "hf": HFTokenizer(sp.to_hf(), pad_id=sp.pad_id, eos_id=sp.eos_id, unk_id=sp.unk_id)}


@pytest.mark.parametrize("kind", list(_kinds()))
def test_written_files_read_back_as_the_same_tokenizer(kind: str, tmp_path: Path) -> None:
    tok = _kinds()[kind]
    names = write_tokenizer_files(tok, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    back = read_tokenizer(tmp_path)
    assert back.kind == kind
    assert back.describe() == tok.describe()
    assert back.encode(SAMPLE) == tok.encode(SAMPLE)
    assert "model" in json.loads((tmp_path / HF_FILE).read_text())  # a `tokenizers` file, not a description


def test_an_older_artifacts_description_in_tokenizer_json_still_loads(tmp_path: Path) -> None:
    (tmp_path / HF_FILE).write_text(json.dumps({"type": "byte", "offset": 2, "pad_id": 0, "eos_id": 1,
                                                "vocab_size": 258}))
    assert read_tokenizer(tmp_path) == ByteTokenizer()


def _sentencepiece_dir(tmp_path: Path) -> Path:
    tmp_path.mkdir(exist_ok=True)
    write_tokenizer_files(sentencepiece_tokenizer(), tmp_path)
    return tmp_path


def test_a_corrupted_sentencepiece_model_is_refused_by_name(tmp_path: Path) -> None:
    d = _sentencepiece_dir(tmp_path)
    data = bytearray((d / SENTENCEPIECE_FILE).read_bytes())
    (d / SENTENCEPIECE_FILE).write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(TokenizerFileError, match=f"^{SENTENCEPIECE_FILE}: not a SentencePiece model"):
        read_tokenizer(d)


def test_a_size_that_disagrees_with_the_description_is_refused(tmp_path: Path) -> None:
    d = _sentencepiece_dir(tmp_path)
    desc = json.loads((d / DESCRIPTION_FILE).read_text())
    (d / DESCRIPTION_FILE).write_text(json.dumps({**desc, "vocab_size": desc["vocab_size"] + 1}))
    with pytest.raises(TokenizerFileError, match=f"^{SENTENCEPIECE_FILE}: has 64 ids, but {DESCRIPTION_FILE} says 65"):
        read_tokenizer(d)


def test_a_tokenizers_file_of_another_size_is_refused(tmp_path: Path) -> None:
    d = _sentencepiece_dir(tmp_path / "sp")
    ByteTokenizer().to_hf().save(str(d / HF_FILE))
    with pytest.raises(TokenizerFileError, match=f"^{HF_FILE}: has 258 ids, but the sentencepiece tokenizer"):
        read_tokenizer(d)
    (d / HF_FILE).write_text('{"model": "truncated')
    with pytest.raises(TokenizerFileError, match=f"^{HF_FILE}: cannot be read as JSON"):
        read_tokenizer(d)


def test_missing_or_unknown_descriptions_are_named(tmp_path: Path) -> None:
    write_tokenizer_files(ByteTokenizer(), tmp_path)
    (tmp_path / DESCRIPTION_FILE).write_text(json.dumps({"type": "wordpiece"}))
    with pytest.raises(TokenizerFileError, match=f"^{DESCRIPTION_FILE}: unknown tokenizer type 'wordpiece'"):
        read_tokenizer(tmp_path)
    (tmp_path / DESCRIPTION_FILE).unlink()
    with pytest.raises(TokenizerFileError, match=f"^{DESCRIPTION_FILE}: missing"):
        read_tokenizer(tmp_path)
