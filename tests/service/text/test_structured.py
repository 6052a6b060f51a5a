"""The constraint engine on each kind of artifact tokenizer (bytes, SentencePiece with byte fallback, a Hugging
Face file with multi-character and special added tokens): any walk through the allowed tokens spells a text
that matches, control tokens are never allowed and end-of-text only where the constraint may end; a batch's
masks are each row's alone; the compile cache keys by content and keeps its cap."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
import torch

from model import ByteTokenizer
from service.text.structured import ConstraintSource, GrammarCompiler, MaskBatch, SequenceConstraint, apply_allowed
from tests.model.tokenizers.helpers import hf_chat_tokenizer, sentencepiece_tokenizer

TOKENIZERS = {"byte": ByteTokenizer, "sentencepiece": lambda: sentencepiece_tokenizer(320, byte_fallback=True),
              "hf": hf_chat_tokenizer}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 2}},
          "required": ["name", "size"], "additionalProperties": False}


def walk(tokenizer: Any, source: ConstraintSource, seed: int, limit: int = 200) -> str:
    """A random path through the allowed tokens (uniform among them) until the constraint ends."""
    grammar = GrammarCompiler(tokenizer).compile_now(source)
    masks = MaskBatch(tokenizer.vocab_size)
    sequence = SequenceConstraint(grammar)
    rng = random.Random(seed)
    ids: list[int] = []
    specials = set(tokenizer.control_tokens().values()) - {tokenizer.eos_id}
    for _ in range(limit):
        allowed = masks.compute([sequence]).allowed[0].nonzero().flatten().tolist()
        assert allowed and not specials & set(allowed), allowed
        token = rng.choice(allowed)
        sequence.consume(token)
        if token == tokenizer.eos_id:
            break
        ids.append(token)
        if sequence.finished:
            break
    assert sequence.finished, tokenizer.decode(ids)
    return str(tokenizer.decode(ids))


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_every_walk_through_the_allowed_tokens_matches(kind: str) -> None:
    tokenizer = TOKENIZERS[kind]()
    for seed in range(4):
        text = walk(tokenizer, ConstraintSource.schema(SCHEMA, "schema"), seed)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert re.fullmatch("[0-9]{2}-[ab]+", walk(tokenizer, ConstraintSource("regex", "[0-9]{2}-[ab]+", "r"), seed))
        # whitespace this SentencePiece model's normalizer folds into one `▁` (tabs, newlines, runs of spaces)
        # comes from its byte pieces
        assert walk(tokenizer, ConstraintSource("choice", '["hello", "ab\\n", "h\\t  é 🤖"]', "c"), seed) in (
            "hello", "ab\n", "h\t  é 🤖")


def test_multi_character_tokens_are_allowed_where_they_fit() -> None:
    tokenizer = hf_chat_tokenizer()
    grammar = GrammarCompiler(tokenizer).compile_now(ConstraintSource("choice", '["hello", "ab\\n"]', "c"))
    allowed = MaskBatch(tokenizer.vocab_size).compute([SequenceConstraint(grammar)]).allowed[0]
    pieces = {tokenizer.id_to_piece(i) for i in allowed.nonzero().flatten().tolist()}
    assert pieces == {"hello", "ab\n", "<0x68>", "<0x61>"}  # the words whole, or their first byte


def test_end_of_text_is_allowed_only_where_the_constraint_may_end() -> None:
    tokenizer = ByteTokenizer()
    grammar = GrammarCompiler(tokenizer).compile_now(ConstraintSource("regex", "a+", "r"))
    masks, sequence = MaskBatch(tokenizer.vocab_size), SequenceConstraint(grammar)
    assert not masks.compute([sequence]).allowed[0, tokenizer.eos_id]
    sequence.consume(tokenizer.encode("a")[0])
    assert masks.compute([sequence]).allowed[0].nonzero().flatten().tolist() == [
        tokenizer.eos_id, tokenizer.encode("a")[0]]
    assert not sequence.finished
    sequence.consume(tokenizer.eos_id)
    assert sequence.finished


def test_a_batch_of_masks_is_each_row_alone() -> None:
    tokenizer = ByteTokenizer()
    compiler = GrammarCompiler(tokenizer)
    sources = [ConstraintSource.schema(SCHEMA, "s"), ConstraintSource("regex", "[0-9]+x", "r"),
               ConstraintSource("choice", '["yes", "no"]', "c")]
    rows: list[SequenceConstraint | None] = [SequenceConstraint(compiler.compile_now(s)) for s in sources]
    for row, prefix in zip(rows, ['{"na', "12", "y"], strict=True):
        for token in tokenizer.encode(prefix):
            assert row is not None
            row.consume(token)
    rows.insert(1, None)  # an unconstrained row
    masks = MaskBatch(tokenizer.vocab_size)
    together = masks.compute(rows).allowed
    assert together[1].all()
    for i, row in enumerate(rows):
        if row is not None:
            assert torch.equal(together[i], masks.compute([row]).allowed[0])
    assert together[3].nonzero().flatten().tolist() == tokenizer.encode("e")


def test_masked_logits_are_a_new_tensor() -> None:
    logits = torch.randn(2, 260)
    allowed = torch.zeros(2, 258, dtype=torch.bool)
    allowed[0, 5] = allowed[1, 7] = True
    before = logits.clone()
    masked = apply_allowed(logits, allowed)
    assert torch.equal(logits, before)  # a prefill's logits may be shared with forks and the prefix cache
    assert masked.argmax(-1).tolist() == [5, 7] and torch.isinf(masked[:, 258:]).all()
    assert torch.isfinite(masked).sum() == 2


def test_the_cache_keys_by_content_and_keeps_its_cap() -> None:
    compiler = GrammarCompiler(ByteTokenizer(), cache_entries=2)
    first = compiler.compile_now(ConstraintSource.schema({"type": "object", "required": ["a"]}, "s"))
    same = compiler.compile_now(ConstraintSource.schema('{"required": ["a"], "type": "object"}', "s"))
    assert same is first  # the same schema in another key order, from its JSON text
    compiler.compile_now(ConstraintSource("regex", "a", "r"))
    compiler.compile_now(ConstraintSource("regex", "b", "r"))
    assert not compiler.holds(ConstraintSource.schema({"type": "object", "required": ["a"]}, "s"))
    assert compiler.holds(ConstraintSource("regex", "b", "r"))
