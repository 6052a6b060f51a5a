"""A SentencePiece model (the `sentencepiece` library) as a model.tokenizer.Tokenizer. The artifact keeps the
model's own bytes (tokenizer.model), which the service encodes and decodes with; its tokenizer.json is the
`tokenizers` conversion transformers makes of the same model, for clients."""

from __future__ import annotations

from typing import Any

import sentencepiece as spm

from .text_only import respell
from .window_decoder import WindowDecoder


class SentencePieceTokenizer:
    def __init__(self, model_proto: bytes, pad_id: int | None = None, eos_id: int | None = None) -> None:
        """`model_proto`: the bytes of a .model file. `pad_id` / `eos_id` replace the model's own (a model
        trained without a padding piece pads with `pad_id`, else its unknown piece). Raises ValueError for
        bytes that are not a SentencePiece model."""
        self.model_proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(self.model_proto)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"not a SentencePiece model ({e})") from e
        own_pad, own_eos = self._sp.pad_id(), self._sp.eos_id()
        self._unk = self._sp.unk_id()
        self._pad = pad_id if pad_id is not None else (own_pad if own_pad >= 0 else self._unk)
        if eos_id is None and own_eos < 0:
            raise ValueError("the SentencePiece model has no end-of-text piece and no eos_id was given")
        self._eos = eos_id if eos_id is not None else own_eos
        for name, value in (("pad_id", self._pad), ("eos_id", self._eos)):
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the model's {self.vocab_size} pieces")
        self._special = frozenset(i for i in range(self.vocab_size) if self.is_special(i))

    @property
    def kind(self) -> str:
        return "sentencepiece"

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int | None:
        bos = int(self._sp.bos_id())
        return bos if bos >= 0 else None

    @property
    def unk_id(self) -> int | None:
        return self._unk if self._unk >= 0 else None

    def encode(self, text: str) -> list[int]:
        """Text only. SentencePiece never matches a control piece in text, but it does match user-defined
        pieces, and the description may name one as eos or pad: such an id is spelled out instead
        (model/tokenizers/text_only.py)."""
        ids = list(self._sp.encode(text, out_type=int))
        if self._special.isdisjoint(ids):
            return ids
        return [i for i, *_ in self.offsets(text)]

    def control_tokens(self) -> dict[str, int]:
        return {str(self._sp.id_to_piece(i)): i for i in sorted(self._special)}

    def is_special(self, token_id: int) -> bool:
        if not 0 <= token_id < self.vocab_size:
            return True
        # the padding id is special unless it is the unknown piece standing in for a missing padding piece
        pad = self._pad != self._unk and token_id == self._pad
        return pad or token_id == self._eos or bool(self._sp.is_control(token_id))

    def decode(self, ids: list[int]) -> str:
        # the unknown piece decodes as " ⁇ " in SentencePiece: it stays, as in SentencePiece's own decode
        return str(self._sp.decode([int(i) for i in ids if not self.is_special(int(i))]))

    def id_to_piece(self, token_id: int) -> str:
        return str(self._sp.id_to_piece(token_id))

    def incremental_decoder(self) -> WindowDecoder:
        return WindowDecoder(self.decode)

    def offsets(self, text: str) -> list[tuple[int, str, int, int]]:
        proto = self._sp.encode(text, out_type="proto")
        # piece.begin/end are byte offsets into the UTF-8 text; the interface gives character offsets
        char_at = _char_index_of_bytes(text)
        pieces = [(int(p.id), text[char_at[p.begin] : char_at[p.end]], char_at[p.begin], char_at[p.end])
                  for p in proto.pieces]
        if self._special.isdisjoint(i for i, *_ in pieces):
            return pieces
        return respell(text, pieces, self._special, lambda char: list(self._sp.encode(char, out_type=int)))

    def describe(self) -> dict[str, Any]:
        return {"type": "sentencepiece", "vocab_size": self.vocab_size, "pad_id": self.pad_id,
                "eos_id": self.eos_id, "bos_id": self.bos_id, "unk_id": self.unk_id}

    def to_hf(self) -> Any:
        """transformers' conversion of this model (it follows the model's normalizer, dummy prefix and
        pieces, so it encodes as SentencePiece does, except that text spelling a control piece such as "</s>"
        becomes that piece's id there, as in transformers' own tokenizers). Needs transformers and protobuf."""
        try:
            from sentencepiece import sentencepiece_model_pb2
            from transformers.convert_slow_tokenizer import SpmConverter
        except ImportError as e:
            raise ValueError(f"writing tokenizer.json for a SentencePiece model needs transformers and protobuf "
                             f"({e}): pip install transformers protobuf") from e
        proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]
        proto.ParseFromString(self.model_proto)
        if proto.trainer_spec.model_type == 2:  # BPE: a piece -> id table, merges derived from the scores
            vocab: Any = {p.piece: i for i, p in enumerate(proto.pieces)}
        else:  # unigram: pieces with their scores
            vocab = [(p.piece, p.score) for p in proto.pieces]
        tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
        if tok is None:
            kind = proto.trainer_spec.model_type
            raise ValueError(f"transformers cannot convert a SentencePiece model of type {kind}")
        return tok


def _char_index_of_bytes(text: str) -> list[int]:
    """For each byte offset 0..len(utf-8 bytes) of `text`, the index of the character it falls in."""
    out: list[int] = []
    for i, ch in enumerate(text):
        out.extend([i] * len(ch.encode("utf-8", errors="surrogatepass")))
    out.append(len(text))
    return out
