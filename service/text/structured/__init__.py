"""Structured output: a generation's text constrained to a JSON schema, any JSON object, a regular expression, a
choice of strings or a Lark/GBNF grammar. `grammars` compiles a request's constraint with llguidance for the
artifact's tokenizer (bounded in size and time, off the event loop and the model worker, cached by content);
`masks` keeps each running sequence's matcher and computes the allowed tokens of a whole decode batch at once."""

from service.text.structured.grammars import (
    ENGINE,
    CompiledGrammar,
    ConstraintSource,
    GrammarCompiler,
    engine_version,
)
from service.text.structured.masks import ConstraintFailed, MaskBatch, SequenceConstraint, apply_allowed

__all__ = ["ENGINE", "CompiledGrammar", "ConstraintFailed", "ConstraintSource", "GrammarCompiler", "MaskBatch",
           "SequenceConstraint", "apply_allowed", "engine_version"]
