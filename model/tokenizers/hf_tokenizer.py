"""A Hugging Face `tokenizers` file (tokenizer.json) as a model.tokenizer.Tokenizer: the library encodes and
decodes; the special ids come from the artifact's description file. Text is only text: its special tokens
spelled out in text are encoded as characters, not as their ids (model/tokenizers/text_only.py)."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer as HFTokenizerModel

from .text_only import respell
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
        special = {i for i in (pad_id, eos_id, bos_id) if i is not None}
        added = tokenizer.get_added_tokens_decoder()
        special |= {i for i, t in added.items() if t.special}
        self._special = frozenset(special)
        # what text may not encode to: the unknown id is how a tokenizer encodes text it has no piece for
        self._not_text = self._special - {unk_id}
        # the spellings a chat template writes for control tokens: the special added tokens' and the named ids'
        self._controls = {t.content: int(i) for i, t in added.items() if t.special}
        for i in (pad_id, eos_id, bos_id, unk_id):
            piece = tokenizer.id_to_token(i) if i is not None else None
            if piece:
                self._controls.setdefault(piece, int(i))  # type: ignore[arg-type]  # i is set where piece is
        # user text is encoded by a copy that matches no special token (`tokenizers`' encode_special_tokens, as
        # transformers' split_special_tokens); the original, which clients get as tokenizer.json, keeps it
        self._text = HFTokenizerModel.from_str(tokenizer.to_str())
        self._text.encode_special_tokens = True

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
        """Text only: a special token spelled out is encoded as its characters (model/tokenizers/text_only.py)."""
        ids = list(self._text.encode(text, add_special_tokens=False).ids)
        if self._not_text.isdisjoint(ids):
            return ids
        return [i for i, *_ in self.offsets(text)]

    def control_tokens(self) -> dict[str, int]:
        return dict(self._controls)

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
        enc = self._text.encode(text, add_special_tokens=False)
        pieces = [(int(i), text[a:b], int(a), int(b)) for i, (a, b) in zip(enc.ids, enc.offsets)]
        if self._not_text.isdisjoint(enc.ids):
            return pieces
        return respell(text, pieces, self._not_text,
                       lambda char: list(self._text.encode(char, add_special_tokens=False).ids))

    def describe(self) -> dict[str, Any]:
        return {"type": "hf", "vocab_size": self.vocab_size, "pad_id": self.pad_id, "eos_id": self.eos_id,
                "bos_id": self.bos_id, "unk_id": self.unk_id}

    def to_hf(self) -> HFTokenizerModel:
        return self._tok
