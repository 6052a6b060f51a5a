"""A tiny SentencePiece model trained on a few KB of multilingual text, and a Hugging Face tokenizer with chat
special tokens, for tests of tokenizers, artifacts, imports and the service."""

from __future__ import annotations

import functools
import io
import random

import sentencepiece as spm
from tokenizers import AddedToken

from model import ByteTokenizer
from model.tokenizers.hf_tokenizer import HFTokenizer
from model.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

WORDS = ("the of and a to in is was it he she we they said old new house street night day Raskolnikov "
         "naïve café résumé über straße Ελληνικά мир 日本語 テキスト 🤖 🚀 €").split()
SAMPLE = "The old café on the straße: naïve résumé, 日本語 テキスト and мир 🤖 — ok?"


def training_text(seed: int = 0, lines: int = 300) -> str:
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(lines))


@functools.lru_cache(maxsize=4)
def sentencepiece_model(vocab_size: int = 64, byte_fallback: bool = False) -> bytes:
    """The bytes of a unigram model (its real size may fall short of `vocab_size` on so little text: read
    it from the tokenizer). With byte_fallback, unseen characters become byte pieces, as in Llama's."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text().splitlines()), model_writer=buf, vocab_size=vocab_size,
        character_coverage=1.0, byte_fallback=byte_fallback, hard_vocab_limit=False, minloglevel=2,
        num_threads=1)
    return buf.getvalue()


def sentencepiece_tokenizer(vocab_size: int = 64, byte_fallback: bool = False) -> SentencePieceTokenizer:
    return SentencePieceTokenizer(sentencepiece_model(vocab_size, byte_fallback))


CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>")


def hf_chat_tokenizer() -> HFTokenizer:
    """A Hugging Face tokenizer with special tokens a chat template writes: the byte tokenizer's ids (pad 0,
    eos 1 spelled `</s>`, bytes from 2), `<|im_start|>` 258 and `<|im_end|>` 259 (special added tokens, as in
    ChatML tokenizers), and two plain added words of several characters (`ab` + newline 260, `hello` 261)."""
    tok = ByteTokenizer().to_hf()
    tok.add_special_tokens([AddedToken("</s>", special=True), *CHAT_SPECIALS])
    tok.add_tokens(["ab\n", "hello"])
    return HFTokenizer(tok, pad_id=0, eos_id=1)
