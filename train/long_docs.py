"""Documents that need long context, built from prose: pure functions of their arguments (randomness comes
from the caller's seeded generator), used alike by the training mixer (train/mixer.py) and the retrieval
benchmark (bench/long_context.py).

- Passkey (Mohtashami & Jaggi, 2023): the task sentence, prose with the hidden sentence at a given depth,
  then the question; the answer is the key's five digits after "The pass key is ".
- Copy: a passage, a gap of other prose, the passage again; the scored bytes are the repeat after its first
  `cue` bytes (before the cue the model cannot know a repeat has begun).

Every document satisfies `data[source] == data[answer]`: `source` is where the scored bytes first appear
(the key in the hidden sentence, the passage's matching span), `answer` where they are to be produced.

Prose cut at arbitrary byte offsets may split a multi-byte UTF-8 character; `utf8_safe` blanks such broken
ends with spaces (same length), so a document always decodes and can be sent to the service as text."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

TASK = (b"There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        b"I will quiz you about the important information there.")
QUESTION = b"What is the pass key? The pass key is "
KEY_DIGITS = 5
_SAYS = b"The pass key is "  # how the hidden sentence begins, just before the key


def needle(key: str) -> bytes:
    return _SAYS + f"{key}. Remember it. {key} is the pass key.".encode()


# task \n before \n needle \n after \n question key: everything but the prose (four newlines)
PASSKEY_OVERHEAD = len(TASK) + len(needle("0" * KEY_DIGITS)) + len(QUESTION) + KEY_DIGITS + 4


@dataclass(frozen=True)
class LongDoc:
    kind: str  # "passkey" or "copy"
    data: bytes
    answer: tuple[int, int]  # [start, end) of the bytes to produce (scored, and weighted in training)
    source: tuple[int, int]  # [start, end) of where the same bytes appear earlier in `data`
    cue: int = 0  # copy: bytes of the repeat shown before the answer (the passage starts at source[0] - cue)
    prose_used: int = 0  # bytes of the given prose the document consumed (from its start)

    @property
    def prompt(self) -> bytes:
        return self.data[: self.answer[0]]

    @property
    def answer_bytes(self) -> bytes:
        return self.data[self.answer[0]:self.answer[1]]

    @property
    def gap(self) -> int:
        """Bytes between the end of the first occurrence and the start of the second (the distance one hop
        must bridge): the hidden sentence's end to the question, or the passage's end to its repeat."""
        if self.kind == "passkey":
            needle_end = self.source[0] - len(_SAYS) + len(needle("0" * KEY_DIGITS))
            return self.answer[0] - len(QUESTION) - 2 - needle_end  # two: the newlines around the prose
        return self.answer[0] - self.cue - self.source[1]


def utf8_safe(b: bytes) -> bytes:
    """`b` with a broken UTF-8 character at either end (cut mid-sequence) replaced by spaces, same length."""
    out = bytearray(b)
    i = 0
    while i < min(3, len(out)) and 0x80 <= out[i] < 0xC0:  # continuation bytes of a character cut off before
        out[i] = 0x20
        i += 1
    n = len(out)
    for back in range(1, min(4, n - i) + 1):
        c = out[n - back]
        if c < 0x80:
            break
        if c >= 0xC0:  # the last lead byte: is its sequence complete?
            need = 2 if c < 0xE0 else 3 if c < 0xF0 else 4
            if back < need:
                out[n - back:] = b" " * back
            break
    return bytes(out)


def random_key(rng: np.random.Generator) -> str:
    return str(int(rng.integers(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS)))


def passkey_parts(prose: bytes, key: str, before: int, after: int) -> LongDoc:
    """A passkey document with `before` prose bytes ahead of the hidden sentence and `after` between it and
    the question (both taken in order from the start of `prose`)."""
    if len(key) != KEY_DIGITS or not key.isdigit():
        raise ValueError(f"the key must be {KEY_DIGITS} digits, got {key!r}")
    if before < 0 or after < 0 or len(prose) < before + after:
        raise ValueError(f"need {before} + {after} prose bytes, got {len(prose)}")
    head = TASK + b"\n" + utf8_safe(prose[:before]) + b"\n"
    hidden = needle(key)
    data = head + hidden + b"\n" + utf8_safe(prose[before:before + after]) + b"\n" + QUESTION + key.encode()
    key_at = len(head) + len(_SAYS)
    end = len(data)
    return LongDoc("passkey", data, (end - KEY_DIGITS, end), (key_at, key_at + KEY_DIGITS),
                   prose_used=before + after)


def passkey_document(prose: bytes, key: str, depth: float, length: int) -> LongDoc:
    """A `length`-byte passkey document ending with the answer (its prompt is everything before the last five
    bytes); the hidden sentence sits after `round(depth * filler)` of the `length - PASSKEY_OVERHEAD` prose
    bytes (depth 0: right after the task sentence, 1: right before the question)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    filler = length - PASSKEY_OVERHEAD
    if filler < 0:
        raise ValueError(f"a passkey document needs at least {PASSKEY_OVERHEAD} bytes, got {length}")
    before = int(round(depth * filler))
    return passkey_parts(prose, key, before, filler - before)


def copy_document(prose: bytes, passage_len: int, gap: int, cue: int) -> LongDoc:
    """The first `passage_len` bytes of `prose`, the next `gap` bytes, then that passage again:
    `2 * passage_len + gap` bytes. The answer is the repeat after its first `cue` bytes."""
    if not 0 <= cue < passage_len:
        raise ValueError(f"the cue ({cue}) must be shorter than the passage ({passage_len})")
    if gap < 0 or len(prose) < passage_len + gap:
        raise ValueError(f"need {passage_len} + {gap} prose bytes, got {len(prose)}")
    passage = utf8_safe(prose[:passage_len])
    data = passage + utf8_safe(prose[passage_len:passage_len + gap]) + passage
    second = passage_len + gap
    return LongDoc("copy", data, (second + cue, second + passage_len), (cue, passage_len), cue=cue,
                   prose_used=passage_len + gap)


def copy_control(doc: LongDoc, other: bytes) -> LongDoc:
    """The same copy document with its first occurrence replaced by `other` prose of the same length: the
    scored bytes and every position stay, only the earlier passage is gone (the copy score's control)."""
    start = doc.source[0] - doc.cue
    n = doc.source[1] - start
    if len(other) < n:
        raise ValueError(f"need {n} bytes of other prose, got {len(other)}")
    return replace(doc, data=doc.data[:start] + utf8_safe(other[:n]) + doc.data[start + n:])


SEP = b"\n\n"  # between a document and the prose around it in a training window


def embed(doc: LongDoc, prose: bytes, lead: int, total: int) -> tuple[bytes, tuple[int, int]]:
    """A `total`-byte window: `lead` bytes of `prose`, the document, then prose again from where the document's
    own filler stopped (`prose[lead:]` is what the document was built from). Returns the window and the
    answer's span in it. Putting the document anywhere in the window keeps the answer off fixed positions:
    a model trained with the question always at one place learned the slot from position embeddings
    (shared/notes/long-range-retrieval.md)."""
    head = prose[:lead] + (SEP if lead else b"")
    rest = prose[lead + doc.prose_used:]
    window = head + doc.data + SEP + rest
    if len(window) < total or len(head) + doc.answer[1] > total:
        raise ValueError(f"the document ({len(doc.data)} bytes after {len(head)}) does not fit {total} bytes")
    at = len(head)
    return window[:total], (at + doc.answer[0], at + doc.answer[1])
