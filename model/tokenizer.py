"""The tokenizer interface every part of the project codes against (service, trainer, exporter, benchmarks),
and its implementations: bytes (ByteTokenizer), SentencePiece (the `sentencepiece` library) and Hugging Face
`tokenizers` files. An artifact carries its tokenizer (model.tokenizers.files reads and writes it)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class TextDecoder(Protocol):
    """Ids in, text out, one id at a time: never half a UTF-8 character, never a dropped word-boundary space.
    Joining every push and the final flush gives the tokenizer's decode of all the ids pushed."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@runtime_checkable
class Tokenizer(Protocol):
    """What a tokenizer offers. `pad_id` and `eos_id` always exist (a SentencePiece model without a padding
    piece pads with its unknown piece: padded positions are masked); `bos_id` and `unk_id` are None where
    the tokenizer has no such piece. `decode` drops special ids and never raises."""

    @property
    def kind(self) -> str: ...  # "byte" | "sentencepiece" | "hf", as the artifact's description file names it

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def unk_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]:
        """Text only: the ids never include a control token that the text spells out (`</s>`, `<|im_end|>`):
        that text is encoded as its characters (model/tokenizers/text_only.py)."""
        ...

    def control_tokens(self) -> dict[str, int]:
        """Spelling -> id of the control tokens (special ids) a chat template may write: the only text that
        becomes control tokens, and only where the service's chat prompt says it is the template's."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def is_special(self, token_id: int) -> bool: ...

    def id_to_piece(self, token_id: int) -> str: ...

    def incremental_decoder(self) -> TextDecoder: ...

    def offsets(self, text: str) -> list[tuple[int, str, int, int]]:
        """(id, its text, start, stop) per token of `text`; start/stop are character offsets into `text`."""
        ...

    def describe(self) -> dict[str, Any]:
        """The artifact's description of this tokenizer (its type, special ids and size)."""
        ...

    def to_hf(self) -> Any:
        """An equivalent `tokenizers.Tokenizer` (same ids for the same text), saved as the artifact's tokenizer.json."""
        ...


from .tokenizers.byte_level import ByteTokenizer, IncrementalDecoder  # noqa: E402  (after the interface it implements)

__all__ = ["ByteTokenizer", "IncrementalDecoder", "TextDecoder", "Tokenizer"]
