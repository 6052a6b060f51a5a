"""A generation's text, token by token, for any tokenizer: the tokenizer's incremental decoder turns ids into
text (never half a UTF-8 character, SentencePiece's word-boundary spaces kept: model/tokenizers), special ids
add no text, and stop sequences are looked for in the text so far, so one that spans token boundaries is
found at the token that completes it: anywhere in the newest token's text (OpenAI, vLLM), or only at the end
of the text (TGI)."""

from __future__ import annotations

from collections.abc import Sequence

from model.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop_sequences: Sequence[str] = (), *, at_end: bool = False) -> None:
        """`at_end`: a stop sequence counts only where the text so far ends with it (TGI); otherwise anywhere
        in the text the newest token added (OpenAI, vLLM), with the characters before it."""
        self._decoder = tokenizer.incremental_decoder()
        self._is_special = tokenizer.is_special
        self._at_end = at_end
        self._stops = [s for s in stop_sequences if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self._tail = ""  # the last characters emitted: enough to hold any stop sequence with the newest text

    def push(self, token_id: int) -> str:
        """The text `token_id` completes ("" for a special id, or while a character or piece is incomplete)."""
        return "" if self._is_special(token_id) else self._decoder.push(token_id)

    def flush(self) -> str:
        """Whatever text is still held back (the generation ended)."""
        return self._decoder.flush()

    def stopped(self, text: str) -> bool:
        """Record `text` as emitted; True if the text so far now holds a stop sequence ending in it."""
        if not self._stops or not text:
            return False
        self._tail = (self._tail + text)[-(self._longest + len(text)) :]
        if self._at_end:
            return any(self._tail.endswith(s) for s in self._stops)
        return any(s in self._tail for s in self._stops)
