"""An artifact's tokenizer on disk. tokenizer.json is always a Hugging Face `tokenizers` file that gives the
service's ids (clients load it with `tokenizers.Tokenizer.from_file` or `transformers.PreTrainedTokenizerFast`);
reformer_tokenizer.json says which tokenizer the service runs and its special ids; a SentencePiece tokenizer
also keeps its model's bytes in tokenizer.model. Artifacts written before this layout have only tokenizer.json,
holding the byte tokenizer's description: read_tokenizer recognises that by its content."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..tokenizer import Tokenizer
from .byte_level import ByteTokenizer
from .hf_tokenizer import HFTokenizer
from .sentencepiece_tokenizer import SentencePieceTokenizer

HF_FILE = "tokenizer.json"
DESCRIPTION_FILE = "reformer_tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"


class TokenizerFileError(ValueError):
    """A tokenizer file that cannot be used; `file` names it and the message says what is wrong."""

    def __init__(self, file: str, problem: str) -> None:
        super().__init__(f"{file}: {problem}")
        self.file = file


def write_tokenizer_files(tokenizer: Tokenizer, directory: Path) -> list[str]:
    """Write the files that describe `tokenizer` into `directory`; returns their names."""
    description = tokenizer.describe()
    names = [HF_FILE, DESCRIPTION_FILE]
    if isinstance(tokenizer, SentencePieceTokenizer):
        (directory / SENTENCEPIECE_FILE).write_bytes(tokenizer.model_proto)
        description["model_file"] = SENTENCEPIECE_FILE
        names.append(SENTENCEPIECE_FILE)
    tokenizer.to_hf().save(str(directory / HF_FILE))
    (directory / DESCRIPTION_FILE).write_text(json.dumps(description, indent=2, sort_keys=True) + "\n")
    return names


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerFileError(path.name, f"cannot be read as JSON ({e})") from e


def is_legacy_description(content: Any) -> bool:
    """An older artifact's tokenizer.json: the byte tokenizer's description, not a `tokenizers` file."""
    return isinstance(content, dict) and "type" in content and "model" not in content


def read_tokenizer(directory: Path, listed: Collection[str] | None = None) -> Tokenizer:
    """The tokenizer an artifact directory carries. Raises TokenizerFileError naming the file at fault.
    `listed`: the files the artifact's manifest lists (and so hashes); a file the tokenizer needs that is not
    among them is refused by name before it is read (None: no manifest, as when writing one)."""
    readable = _Readable(directory, listed)
    hf_path = readable(HF_FILE)
    if not hf_path.is_file():
        raise TokenizerFileError(HF_FILE, f"missing from {directory}")
    hf_content = _read_json(hf_path)
    if is_legacy_description(hf_content):
        try:
            return ByteTokenizer.from_dict(hf_content)
        except (ValueError, KeyError, TypeError) as e:
            raise TokenizerFileError(HF_FILE, f"not a valid tokenizer description ({e})") from e
    if listed is not None and DESCRIPTION_FILE not in listed and not (directory / DESCRIPTION_FILE).exists():
        raise TokenizerFileError(DESCRIPTION_FILE, f"missing from {directory} (it says which tokenizer "
                                 f"{HF_FILE} is and its special ids)")
    desc_path = readable(DESCRIPTION_FILE)
    if not desc_path.is_file():
        raise TokenizerFileError(DESCRIPTION_FILE, f"missing from {directory} (it says which tokenizer "
                                 f"{HF_FILE} is and its special ids)")
    desc = _read_json(desc_path)
    if not isinstance(desc, dict):
        raise TokenizerFileError(DESCRIPTION_FILE, "expected a JSON object")
    tokenizer = _from_description(readable, desc, hf_path)
    _check_hf_file(hf_path, tokenizer)
    return tokenizer


class _Readable:
    """The path of a file the tokenizer is about to read, once it is known to be listed."""

    def __init__(self, directory: Path, listed: Collection[str] | None) -> None:
        self.directory = directory
        self.listed = listed

    def __call__(self, name: str) -> Path:
        if self.listed is not None and name not in self.listed:
            raise TokenizerFileError(name, "not listed in the artifact's manifest: every file the loader reads "
                                     "must be listed with its sha256 (re-export the artifact, or rewrite its "
                                     "manifest with export.artifact.write_manifest)")
        return self.directory / name


def sizing_file(directory: Path) -> str:
    """The file that states the artifact's tokenizer size: the description, or an older artifact's tokenizer.json."""
    return DESCRIPTION_FILE if (directory / DESCRIPTION_FILE).is_file() else HF_FILE


def _from_description(readable: _Readable, desc: dict[str, Any], hf_path: Path) -> Tokenizer:
    directory = readable.directory
    kind = desc.get("type")
    ids = {k: desc.get(k) for k in ("pad_id", "eos_id")}
    try:
        if kind == "byte":
            return ByteTokenizer.from_dict(desc)
        if kind == "sentencepiece":
            name = desc.get("model_file", SENTENCEPIECE_FILE)
            if Path(str(name)).name != name:
                raise TokenizerFileError(str(name), f"not a plain file name ({DESCRIPTION_FILE} names it)")
            model_path = readable(str(name))
            if not model_path.is_file():
                raise TokenizerFileError(str(name), f"missing from {directory} ({DESCRIPTION_FILE} names it)")
            try:
                sp: Tokenizer = SentencePieceTokenizer(model_path.read_bytes(), **ids)
            except ValueError as e:
                raise TokenizerFileError(str(name), str(e)) from e
            _check_size(str(name), sp, desc)
            return sp
        if kind == "hf":
            try:
                hf: Tokenizer = HFTokenizer.from_str(hf_path.read_text(), **ids, bos_id=desc.get("bos_id"),
                                                     unk_id=desc.get("unk_id"))
            except (ValueError, UnicodeDecodeError) as e:
                raise TokenizerFileError(HF_FILE, str(e)) from e
            _check_size(HF_FILE, hf, desc)
            return hf
    except (KeyError, TypeError) as e:
        raise TokenizerFileError(DESCRIPTION_FILE, f"incomplete description ({e!r})") from e
    except ValueError as e:
        if isinstance(e, TokenizerFileError):
            raise
        raise TokenizerFileError(DESCRIPTION_FILE, str(e)) from e
    raise TokenizerFileError(DESCRIPTION_FILE, f"unknown tokenizer type {kind!r} (byte, sentencepiece or hf)")


def _check_size(file: str, tokenizer: Tokenizer, desc: dict[str, Any]) -> None:
    if desc.get("vocab_size") != tokenizer.vocab_size:
        raise TokenizerFileError(file, f"has {tokenizer.vocab_size} ids, but {DESCRIPTION_FILE} says "
                                 f"{desc.get('vocab_size')}")


def _check_hf_file(hf_path: Path, tokenizer: Tokenizer) -> None:
    """tokenizer.json must be a `tokenizers` file of the same size, whichever tokenizer the service runs."""
    if isinstance(tokenizer, HFTokenizer):
        return  # it was parsed as the tokenizer itself
    from tokenizers import Tokenizer as HFTokenizerModel

    try:
        size = HFTokenizerModel.from_file(str(hf_path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the Rust side raises a plain Exception for any malformed file
        raise TokenizerFileError(HF_FILE, f"not a `tokenizers` file ({e})") from e
    if size != tokenizer.vocab_size:
        raise TokenizerFileError(HF_FILE, f"has {size} ids, but the {tokenizer.kind} tokenizer it stands for "
                                 f"has {tokenizer.vocab_size}")
