"""Incremental detokenization for tokenizers whose pieces do not map to text one by one (SentencePiece drops
the word-boundary space of a text's first piece; byte-fallback pieces are parts of a character): decode a
window of the previous ids plus the new ones and emit only the text the new ids added, as TGI and vLLM do."""

from __future__ import annotations

from collections.abc import Callable

_INCOMPLETE = "\ufffd"  # what a decode of part of a character ends with
# a UTF-8 character is at most 4 bytes (4 byte pieces): ids held longer than this never complete one, and
# holding more would make every push decode a growing window
_MAX_HELD = 4


class WindowDecoder:
    """`decode` is the tokenizer's (ids -> text, special ids dropped). The window starts where the previously
    emitted text began, so a piece's leading space is kept relative to what came before it; text that ends
    in U+FFFD is held back until the ids that complete the character arrive (or flush gives it as it is).
    Where new ids change how the window's earlier ids decode, the earlier text is already out: only the
    characters beyond its length are emitted, as vLLM does."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: the first id of the text emitted last
        self._read = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        waiting = len(self._ids) - self._read
        if not final and waiting <= _MAX_HELD and (after.endswith(_INCOMPLETE) or len(after) <= len(before)):
            return ""  # half a character, or a piece that adds no text yet
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]
