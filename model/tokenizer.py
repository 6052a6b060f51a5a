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
    def vocab_size(self) -> int:
        return 256 + self.offset

    def is_special(self, token_id: int) -> bool:
        return token_id < self.offset or token_id == self.eos_id

    def encode(self, text: str) -> list[int]:
        # surrogatepass keeps lone surrogates round-trippable instead of raising
        return [b + self.offset for b in text.encode("utf-8", errors="surrogatepass")]

    def token_bytes(self, ids: list[int]) -> bytes:
        return bytes(i - self.offset for i in ids if not self.is_special(i) and i < self.vocab_size)

    def decode(self, ids: list[int]) -> str:
        """Never raises: a broken multi-byte sequence becomes U+FFFD."""
        return self.token_bytes(list(ids)).decode("utf-8", errors="replace")

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

    def to_dict(self) -> dict[str, Any]:
        return {"type": "byte", "offset": self.offset, "pad_id": self.pad_id, "eos_id": self.eos_id,
                "vocab_size": self.vocab_size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ByteTokenizer:
        if d.get("type") != "byte":
            raise ValueError(f"unsupported tokenizer type {d.get('type')!r}; only 'byte' is known")
        return cls(offset=int(d["offset"]), pad_id=int(d["pad_id"]), eos_id=int(d["eos_id"]))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ByteTokenizer:
        return cls.from_dict(json.loads(Path(path).read_text()))


class IncrementalDecoder:
    """Turns a stream of token ids into text without ever emitting half a character."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_bytes([token_id]), final=False)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
