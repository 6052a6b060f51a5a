from __future__ import annotations

import pytest

from model import ByteTokenizer

TEXTS = ["", "plain ascii", "naïve café", "日本語のテキスト", "emoji 🤖🚀 mixed", "nul\x00byte", "tab\tnew\nline",
         "lone \ud800 surrogate"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_lossless(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(tok.offset <= i < tok.vocab_size for i in ids)
    decoded = tok.decode(ids)
    if "\ud800" in text:
        # a lone surrogate is not valid UTF-8; it round-trips as replacement characters, never an error
        assert decoded.startswith("lone ") and decoded.endswith(" surrogate")
    else:
        assert decoded == text


def test_decode_never_raises_on_split_characters() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("é🤖")
    assert tok.decode(ids[:1]) == "\ufffd"
    assert tok.decode(ids[:-1]).startswith("é")


def test_incremental_decoder_never_emits_half_a_character() -> None:
    tok = ByteTokenizer()
    text = "a é 🤖 日本"
    dec = tok.incremental_decoder()
    pieces = [dec.push(i) for i in tok.encode(text)] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[tok.encode(text).index(tok.encode("🤖")[0])] == ""  # first byte of the emoji: nothing yet


def test_specials_and_offsets() -> None:
    tok = ByteTokenizer()
    assert tok.decode([tok.pad_id, tok.eos_id] + tok.encode("x")) == "x"
    assert tok.vocab_size == 258
    offsets = tok.offsets("aé")
    assert [o[2:] for o in offsets] == [(0, 1), (1, 2), (1, 2)]
    assert [o[0] for o in offsets] == tok.encode("aé")


def test_enwik8_scheme_and_serialisation(tmp_path) -> None:
    tok = ByteTokenizer(eos_id=2)
    assert tok.encode("\x00") == [2] and tok.is_special(2)
    tok.save(tmp_path / "tokenizer.json")
    assert ByteTokenizer.load(tmp_path / "tokenizer.json") == tok
