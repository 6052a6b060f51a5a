"""Documents that need long context, built from prose: pure functions of their arguments (randomness comes
from the caller's seeded generator), used alike by the training mixer (train/mixer.py) and the retrieval
benchmark (bench/long_context.py).

- Passkey (Mohtashami & Jaggi, 2023): the task sentence, prose with the hidden sentence at a given depth,
  then the question; the answer is the key's five digits after "The pass key is ".
- Copy: a passage (prose, or random printable bytes that no prior can guess), a gap of other prose, the
  passage again; the scored bytes are the repeat after its first `cue` bytes (before the cue the model cannot
  know a repeat has begun).

Passkey filler is either prose or the standard repeated lines (`STANDARD_FILLER`, "The grass is green...").

Every document satisfies `data[source] == data[answer]`: `source` is where the scored bytes first appear
(the key in the hidden sentence, the passage's matching span), `answer` where they are to be produced.

Prose cut at arbitrary byte offsets may split a multi-byte UTF-8 character; `utf8_safe` blanks such broken
ends with spaces (same length), so a document always decodes and can be sent to the service as text."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

TASK = (b"There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        b"I will quiz you about the important information there.")
QUESTION = b"What is the pass key? The pass key is "
KEY_DIGITS = 5
STANDARD_FILLER = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PRINTABLE = bytes(range(32, 127))  # the alphabet of random copy passages: text the service accepts
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


def standard_filler(n: int) -> bytes:
    """`n` bytes of the standard passkey filler, repeated (the last repeat cut)."""
    return (STANDARD_FILLER * (n // len(STANDARD_FILLER) + 1))[:n]


def random_passage(rng: np.random.Generator, n: int) -> bytes:
    """`n` random printable ASCII bytes: a copy passage only the earlier occurrence can predict."""
    return bytes(rng.choice(np.frombuffer(PRINTABLE, dtype=np.uint8), size=n).astype(np.uint8))


def log_uniform_gap(rng: np.random.Generator, lo: int, hi: int) -> int:
    """A gap in [lo, hi] with log(gap + 1) uniform: as many gaps inside the local window as between it and
    the window's length (a square-root draw almost never trained the near case); `hi < lo` gives `hi`."""
    lo, hi = max(lo, 0), max(hi, 0)
    if hi <= lo:
        return hi
    g = int(math.floor(math.exp(rng.uniform(math.log(lo + 1), math.log(hi + 2))))) - 1
    return min(max(g, lo), hi)


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
    if len(prose) < passage_len + gap:
        raise ValueError(f"need {passage_len} + {gap} prose bytes, got {len(prose)}")
    doc = repeat_document(utf8_safe(prose[:passage_len]), prose[passage_len:], gap, cue)
    return replace(doc, prose_used=passage_len + gap)


def repeat_document(passage: bytes, prose: bytes, gap: int, cue: int) -> LongDoc:
    """`passage`, the first `gap` bytes of `prose`, then `passage` again; the answer is the repeat after its
    first `cue` bytes (a random passage: the prose consumed is the gap alone)."""
    n = len(passage)
    if not 0 <= cue < n:
        raise ValueError(f"the cue ({cue}) must be shorter than the passage ({n})")
    if gap < 0 or len(prose) < gap:
        raise ValueError(f"need {gap} prose bytes for the gap, got {len(prose)}")
    data = passage + utf8_safe(prose[:gap]) + passage
    second = n + gap
    return LongDoc("copy", data, (second + cue, second + n), (cue, n), cue=cue, prose_used=gap)


def copy_control(doc: LongDoc, other: bytes) -> LongDoc:
    """The same copy document with its first occurrence replaced by `other` prose of the same length: the
    scored bytes and every position stay, only the earlier passage is gone (the copy score's control)."""
    start = doc.source[0] - doc.cue
    n = doc.source[1] - start
    if len(other) < n:
        raise ValueError(f"need {n} bytes of other prose, got {len(other)}")
    return replace(doc, data=doc.data[:start] + utf8_safe(other[:n]) + doc.data[start + n:])


SEP = b"\n\n"  # between a document and the prose around it in a training window (train/mixer.py)
