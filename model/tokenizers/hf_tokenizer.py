"""A Hugging Face `tokenizers` file (tokenizer.json) as a model.tokenizer.Tokenizer: the library encodes and
decodes; the special ids come from the artifact's description file."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer as HFTokenizerModel

from .window_decoder import WindowDecoder


class HFTokenizer:
    def __init__(self, tokenizer: HFTokenizerModel, pad_id: int, eos_id: int, bos_id: int | None = None,
                 unk_id: int | None = None) -> None:
        self._tok = tokenizer
        self._pad, self._eos, self._bos, self._unk = pad_id, eos_id, bos_id, unk_id
        size = self.vocab_size
        for name, value in (("pad_id", pad_id), ("eos_id", eos_id), ("bos_id", bos_id), ("unk_id", unk_id)):
            if value is not None and not 0 <= value < size:
                raise ValueError(f"{name} {value} is outside the tokenizer's {size} ids")
        self._special = {i for i in (pad_id, eos_id, bos_id) if i is not None}
        self._special |= {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    @classmethod
    def from_str(cls, text: str, **ids: Any) -> HFTokenizer:
        try:
            tok = HFTokenizerModel.from_str(text)
        except Exception as e:  # the Rust side raises a plain Exception for any malformed file
            raise ValueError(f"not a `tokenizers` file ({e})") from e
        return cls(tok, **ids)

    @property
    def kind(self) -> str:
        return "hf"

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def unk_id(self) -> int | None:
        return self._unk

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special or not 0 <= token_id < self.vocab_size

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids if not self.is_special(int(i))],
                                    skip_special_tokens=True))

    def id_to_piece(self, token_id: int) -> str:
        return str(self._tok.id_to_token(token_id) or "")

    def incremental_decoder(self) -> WindowDecoder:
        return WindowDecoder(self.decode)

    def offsets(self, text: str) -> list[tuple[int, str, int, int]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return [(int(i), text[a:b], int(a), int(b)) for i, (a, b) in zip(enc.ids, enc.offsets)]

    def describe(self) -> dict[str, Any]:
        return {"type": "hf", "vocab_size": self.vocab_size, "pad_id": self.pad_id, "eos_id": self.eos_id,
                "bos_id": self.bos_id, "unk_id": self.unk_id}

    def to_hf(self) -> HFTokenizerModel:
        return self._tok
