"""Byte-level tokenizer: UTF-8 bytes shifted by a fixed offset, below which sit the special ids.
The default (offset 2, pad 0, eos 1) round-trips every Unicode string, NUL included.
`google/reformer-enwik8` uses offset 2 with eos 2, which makes the NUL byte its end-of-text id;
`ByteTokenizer(eos_id=2)` reproduces that for imported checkpoints."""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ByteTokenizer:
    offset: int = 2
    pad_id: int = 0
    eos_id: int = 1

    @property
    def kind(self) -> str:
        return "byte"

    @property
    def vocab_size(self) -> int:
        return 256 + self.offset

    @property
    def bos_id(self) -> int | None:
        return None

    @property
    def unk_id(self) -> int | None:
        return None  # every string has bytes: nothing is unknown

    def is_special(self, token_id: int) -> bool:
        return token_id < self.offset or token_id == self.eos_id

    def control_tokens(self) -> dict[str, int]:
        """The spellings a chat template writes for the special ids (`</s>`): text that spells them otherwise
        is its bytes."""
        ids = {*range(self.offset), self.eos_id}
        return {self.id_to_piece(i): i for i in sorted(ids)}

    def encode(self, text: str) -> list[int]:
        # surrogatepass keeps lone surrogates round-trippable instead of raising
        return [b + self.offset for b in text.encode("utf-8", errors="surrogatepass")]

    def token_bytes(self, ids: list[int]) -> bytes:
        return bytes(i - self.offset for i in ids if not self.is_special(i) and i < self.vocab_size)

    def decode(self, ids: list[int]) -> str:
        """Never raises: a broken multi-byte sequence becomes U+FFFD."""
        return self.token_bytes(list(ids)).decode("utf-8", errors="replace")

    def id_to_piece(self, token_id: int) -> str:
        return special_name(self, token_id) if token_id < self.offset else byte_piece(token_id - self.offset)

    def incremental_decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)

    def offsets(self, text: str) -> list[tuple[int, str, int, int]]:
        """(id, text of the character it belongs to, start, stop) per token; start/stop are character
        offsets of that character in `text`, so every byte of a multi-byte character maps to it."""
        out: list[tuple[int, str, int, int]] = []
        for pos, ch in enumerate(text):
            for b in ch.encode("utf-8", errors="surrogatepass"):
                out.append((b + self.offset, ch, pos, pos + 1))
        return out

    def describe(self) -> dict[str, Any]:
        return {"type": "byte", "offset": self.offset, "pad_id": self.pad_id, "eos_id": self.eos_id,
                "vocab_size": self.vocab_size}

    to_dict = describe

    def to_hf(self) -> Any:
        """The same ids as a `tokenizers` file: a BPE model without merges whose vocabulary is the 256 byte
        pieces <0x00>..<0xFF> at offset.. and the special ids below; byte fallback turns every character into
        its UTF-8 bytes. The specials are plain vocabulary entries, not added tokens, so text that spells
        "</s>" encodes as its bytes, as here."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models

        vocab = {special_name(self, i): i for i in range(self.offset)}
        vocab.update({byte_piece(b): b + self.offset for b in range(256)})
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, fuse_unk=False))
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        return tok

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ByteTokenizer:
        if d.get("type") != "byte":
            raise ValueError(f"unsupported tokenizer type {d.get('type')!r}; only 'byte' is known")
        tok = cls(offset=int(d["offset"]), pad_id=int(d["pad_id"]), eos_id=int(d["eos_id"]))
        if "vocab_size" in d and int(d["vocab_size"]) != tok.vocab_size:
            raise ValueError(f"vocab_size {d['vocab_size']} does not match offset {tok.offset} + 256 byte ids")
        return tok

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.describe(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ByteTokenizer:
        return cls.from_dict(json.loads(Path(path).read_text()))


def byte_piece(b: int) -> str:
    return f"<0x{b:02X}>"  # SentencePiece's and `tokenizers`' byte-fallback spelling


def special_name(tok: ByteTokenizer, token_id: int) -> str:
    if token_id == tok.pad_id:
        return "<pad>"
    if token_id == tok.eos_id:
        return "</s>"
    return f"<special_{token_id}>"


class IncrementalDecoder:
    """Turns a stream of token ids into text without ever emitting half a character."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_bytes([token_id]), final=False)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
