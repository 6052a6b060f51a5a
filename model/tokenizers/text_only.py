"""User text is only text: an encoding never holds a control token (a special id) that the text spelled out.
Hugging Face tokenizers match their added special tokens (`<|im_end|>`, `</s>`) in text, and a SentencePiece
model its user-defined pieces, one of which a description file may name as eos or pad; the tokenizers here
encode with that matching off, and `respell` is the net under it: a special id an encoding still holds is
replaced by the encoding of its characters one at a time. Control tokens come only from token ids a client
sends or from the spellings a chat template writes (`control_tokens`, service/text/chat_prompt.py)."""

from __future__ import annotations

from collections.abc import Callable


class ControlTokenText(ValueError):
    """Text with a character that this tokenizer can encode only as a control token."""

    def __init__(self, position: int, char: str, token_id: int) -> None:
        super().__init__(f"character {position} ({char!r}) can only be encoded as the control token {token_id}")
        self.position = position


Piece = tuple[int, str, int, int]  # (id, its text, start, stop): start/stop are character offsets


def respell(text: str, pieces: list[Piece], special: frozenset[int] | set[int],
            encode: Callable[[str], list[int]]) -> list[Piece]:
    """`pieces` with each special id replaced by the encoding of its text's characters, one at a time (each
    such id given that character's span). Raises ControlTokenText where a character alone is special."""
    out: list[Piece] = []
    for token_id, piece, start, stop in pieces:
        if token_id not in special:
            out.append((token_id, piece, start, stop))
            continue
        for pos in range(start, stop):
            ids = encode(text[pos])
            for i in ids:
                if i in special:
                    raise ControlTokenText(pos, text[pos], i)
                out.append((i, text[pos], pos, pos + 1))
    return out
