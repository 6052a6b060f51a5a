from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFFile

from model import ByteTokenizer
from model.tokenizer import Tokenizer
from model.tokenizers.hf_tokenizer import HFTokenizer

from .helpers import SAMPLE, sentencepiece_tokenizer, training_text

TEXTS = [SAMPLE, "nul\x00byte and \x00\x00 twice", "  leading and  double  spaces ", "line\nbreaks\n\n here",
         "emoji 🤖🚀 mixed with 日本語テキスト", "unseen ☃ 中 characters ✓", training_text(seed=5, lines=3)]


def all_tokenizers() -> dict[str, Tokenizer]:
    sp = sentencepiece_tokenizer()
    return {"byte": ByteTokenizer(), "enwik8-bytes": ByteTokenizer(eos_id=2), "sentencepiece": sp,
            "sentencepiece-byte-fallback": sentencepiece_tokenizer(320, byte_fallback=True),
            "hf": HFTokenizer(sp.to_hf(), pad_id=sp.pad_id, eos_id=sp.eos_id, unk_id=sp.unk_id)}


@pytest.mark.parametrize("name", list(all_tokenizers()))
def test_every_tokenizer_implements_the_interface(name: str) -> None:
    tok = all_tokenizers()[name]
    assert isinstance(tok, Tokenizer)
    assert 0 <= tok.pad_id < tok.vocab_size and 0 <= tok.eos_id < tok.vocab_size
    assert tok.is_special(tok.eos_id)
    ids = tok.encode(SAMPLE)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids + [tok.eos_id]) == tok.decode(ids)  # special ids add no text
    assert tok.describe()["vocab_size"] == tok.vocab_size and tok.describe()["type"] == tok.kind


@pytest.mark.parametrize("name", list(all_tokenizers()))
def test_the_tokenizers_file_gives_the_same_ids(name: str, tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = all_tokenizers()[name]
    tok.to_hf().save(str(tmp_path / "tokenizer.json"))
    from_file = HFFile.from_file(str(tmp_path / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert from_file.get_vocab_size() == tok.vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert from_file.encode(text).ids == ids, text
        assert fast(text, add_special_tokens=False)["input_ids"] == ids, text
        # decodes agree on ordinary pieces (special ids are dropped here; the unknown piece is spelled
        # differently: SentencePiece's surface against the piece's name)
        plain = [i for i in ids if not tok.is_special(i) and i != tok.unk_id]
        assert from_file.decode(plain) == tok.decode(plain), text


@pytest.mark.parametrize("name", ["byte", "enwik8-bytes"])
def test_bytes_round_trip_through_the_tokenizers_file(name: str) -> None:
    tok = all_tokenizers()[name]
    hf = tok.to_hf()
    text = "héllo\x00wörld 🤖 </s><pad>"  # NUL, multi-byte characters and the specials' spelling
    assert hf.encode(text).ids == [b + 2 for b in text.encode()]
    assert hf.decode(hf.encode(text).ids) == text


@pytest.mark.parametrize("name", list(all_tokenizers()))
def test_incremental_decoding_joins_to_the_whole_decode(name: str) -> None:
    tok = all_tokenizers()[name]
    for text in TEXTS:
        ids = tok.encode(text)
        for n in range(1, len(ids) + 1):  # every prefix: a generation can stop anywhere
            dec = tok.incremental_decoder()
            parts = [dec.push(i) for i in ids[:n]] + [dec.flush()]
            whole = tok.decode(ids[:n])
            assert "".join(parts) == whole, (text, n)
            if "\ufffd" not in whole:
                assert all("\ufffd" not in p for p in parts), (text, n)  # never half a character


def test_sentencepiece_streams_keep_word_boundary_spaces() -> None:
    tok = sentencepiece_tokenizer()
    dec = tok.incremental_decoder()
    parts = [dec.push(i) for i in tok.encode("the old house")] + [dec.flush()]
    assert "".join(parts) == "the old house"
    assert sum(p.count(" ") for p in parts) == 2


def test_sentencepiece_offsets_are_character_offsets() -> None:
    tok = sentencepiece_tokenizer()
    text = "café 🤖 мир"
    spans = tok.offsets(text)
    assert [i for i, _, _, _ in spans] == tok.encode(text)
    assert all(piece == text[a:b] for _, piece, a, b in spans)
    assert "".join(piece for _, piece, _, _ in spans).replace(" ", "") == text.replace(" ", "")


def test_sentencepiece_refuses_bytes_that_are_not_a_model() -> None:
    from model.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

    with pytest.raises(ValueError, match="not a SentencePiece model"):
        SentencePieceTokenizer(b"\x00garbage" * 10)


def test_a_stream_of_broken_bytes_is_not_held_forever() -> None:
    tok = sentencepiece_tokenizer(320, byte_fallback=True)
    lead = tok.encode("☃")[-3]  # the first byte piece of a three-byte character the model has no piece for
    assert tok.id_to_piece(lead).startswith("<0x")
    dec = tok.incremental_decoder()
    parts = [dec.push(lead) for _ in range(12)]  # lead bytes that no continuation ever completes
    assert any(parts) and "".join(parts) + dec.flush() == tok.decode([lead] * 12)
