"""The tokenizer of a transformers checkpoint directory, as the artifact will carry it: its SentencePiece model
(spiece.model, or the file tokenizer_config.json's vocab_file names), else its `tokenizers` file
(tokenizer.json), else, for a byte-level vocabulary of 258 such as google/reformer-enwik8's, bytes + 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from model import ByteTokenizer, ReformerConfig
from model.tokenizer import Tokenizer
from model.tokenizers.hf_tokenizer import HFTokenizer
from model.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

from .hf_errors import HFImportError

SENTENCEPIECE_NAMES = ("spiece.model", "sentencepiece.bpe.model", "tokenizer.model")
BYTE_LEVEL_VOCAB = 258


def _special_ids(config: ReformerConfig) -> dict[str, int | None]:
    """The checkpoint config's end-of-text and padding ids (None where it has none)."""
    eos = config.eos_token_id if config.eos_token_id >= 0 else None
    pad = config.pad_token_id if config.pad_token_id >= 0 else None
    return {"eos_id": eos, "pad_id": pad}


def _tokenizer_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFImportError(f"{path}: not valid JSON ({e})") from e
    return content if isinstance(content, dict) else {}


def _sentencepiece_file(hf_dir: Path) -> Path | None:
    named = _tokenizer_config(hf_dir).get("vocab_file")
    names = ([named] if isinstance(named, str) and Path(named).name == named else []) + list(SENTENCEPIECE_NAMES)
    return next((hf_dir / n for n in names if (hf_dir / n).is_file()), None)


def checkpoint_tokenizer(hf_dir: Path, config: ReformerConfig) -> tuple[Tokenizer, str]:
    """-> (the tokenizer, where it came from). Raises HFImportError naming the file that is unusable, or
    saying which file is missing."""
    ids = _special_ids(config)
    sp_path = _sentencepiece_file(hf_dir)
    if sp_path is not None:
        try:
            tok: Tokenizer = SentencePieceTokenizer(sp_path.read_bytes(), **ids)
        except ValueError as e:
            raise HFImportError(f"{sp_path}: {e}") from e
        source = sp_path.name
    elif (hf_dir / "tokenizer.json").is_file():
        tok, source = _tokenizers_file(hf_dir / "tokenizer.json", ids), "tokenizer.json"
    elif config.vocab_size == BYTE_LEVEL_VOCAB:
        # bytes + 2, as google/reformer-enwik8, which ships no tokenizer (NUL doubles as end of text)
        return ByteTokenizer(eos_id=2), "bytes + 2 (no tokenizer file; vocab_size 258)"
    else:
        raise HFImportError(f"{hf_dir}: vocab_size {config.vocab_size} is not byte-level ({BYTE_LEVEL_VOCAB}) and "
                            f"there is no tokenizer: neither {' / '.join(SENTENCEPIECE_NAMES)} nor tokenizer.json")
    if tok.vocab_size != config.vocab_size:
        raise HFImportError(f"{hf_dir / source}: the tokenizer has {tok.vocab_size} ids, but config.json's "
                            f"vocab_size is {config.vocab_size}")
    return tok, source


def _tokenizers_file(path: Path, ids: dict[str, int | None]) -> Tokenizer:
    from tokenizers import Tokenizer as HFFile

    try:
        hf = HFFile.from_file(str(path))
    except Exception as e:  # the Rust side raises a plain Exception for any malformed file
        raise HFImportError(f"{path}: not a `tokenizers` file ({e})") from e
    eos = ids["eos_id"] if ids["eos_id"] is not None else hf.token_to_id("</s>")
    if eos is None:
        raise HFImportError(f"{path}: no end-of-text id (config.json has no eos_token_id, and there is no </s>)")
    pad = ids["pad_id"] if ids["pad_id"] is not None else eos
    try:
        return HFTokenizer(hf, pad_id=pad, eos_id=eos, bos_id=hf.token_to_id("<s>"), unk_id=hf.token_to_id("<unk>"))
    except ValueError as e:
        raise HFImportError(f"{path}: {e}") from e
