"""A request's output constraint compiled by llguidance for the artifact's tokenizer.

Compiling runs on this module's own threads, never on the event loop or the model worker, and is bounded
three ways: the source's size (`max_source_bytes`), llguidance's parser limits (grammar symbols, lexer fuel:
a schema built to explode is refused by the library itself in milliseconds) and a wall-clock timeout the
caller waits at most (`timeout_s`, its wait for a free compile thread included: the request is refused then,
while the compile, which cannot be stopped, runs on; its result is cached when it ends, as refused if the
compile itself took longer than `timeout_s`, so such a source is refused at once the next time). Results,
refusals included, are kept in an LRU keyed by the source's content, so a repeated schema costs a dictionary
look-up."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any, Literal, NoReturn

import llguidance

from model.tokenizer import Tokenizer
from service.errors import ValidationFailed

ENGINE = "llguidance"

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
# What a refusal is counted as (reformer_structured_refused_total's `reason`).
RefusalReason = Literal["invalid", "too_large", "timeout"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = ("invalid", "too_large", "timeout")
Refusal = tuple[RefusalReason, str]  # why, and what the client is told

# llguidance's own limits, as its defaults but without the parser state in error messages (a refusal's text
# goes to the client: it names the construct, not the library's internals).
_LIMITS = dict(verbose_errors=False)


def engine_version() -> str:
    return version(ENGINE)


@dataclass(frozen=True)
class ConstraintSource:
    """What a request asks its output to match: `kind` and its canonical text (a schema as JSON with sorted
    keys, so the same schema spelt in another key order shares a cache entry), and `field` the request field
    that asked (named in a refusal)."""

    kind: ConstraintKind
    text: str
    field: str

    @property
    def key(self) -> str:
        return f"{self.kind}\x00{self.text}"

    @staticmethod
    def schema(value: Any, field: str) -> ConstraintSource:
        """A JSON schema given as an object or as its JSON text."""
        try:
            if isinstance(value, str):
                value = json.loads(value)
            text = json.dumps(value, sort_keys=True, ensure_ascii=False)
        except json.JSONDecodeError as err:
            raise ValidationFailed(f"{field} is not valid JSON: {err.msg} at character {err.pos}",
                                   param=field) from None
        except RecursionError:
            raise ValidationFailed(f"{field} nests too deep", param=field) from None
        except ValueError as err:  # an integer of more digits than Python converts (4300)
            raise ValidationFailed(f"{field} holds a number too long to read ({str(err)[:60]})",
                                   param=field) from None
        if not isinstance(value, dict):
            raise ValidationFailed(f"{field} must be a JSON schema (an object)", param=field)
        return ConstraintSource("json_schema", text, field)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A compiled constraint: a pristine matcher, never advanced; each sequence starts from a deep copy of it
    (service/text/structured/masks.py SequenceConstraint). `compile_s`: what compiling it took."""

    kind: ConstraintKind
    key: str
    matcher: llguidance.LLMatcher
    compile_s: float


def grammar_text(source: ConstraintSource) -> str:
    """llguidance's grammar for the source. A JSON schema's output is compact JSON (no whitespace between
    tokens, as vLLM's disable_any_whitespace): a model free to add whitespace can spend its whole budget on
    it. `json_object` is any JSON object; `grammar` is a Lark grammar, or GBNF (llama.cpp's, with `::=`)."""
    if source.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults={"whitespace_flexible": False})
    if source.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(source.text, defaults={"whitespace_flexible": False})
    return llguidance.grammar_from(source.kind, source.text)


def special_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids that are not text: control tokens, padding, end-of-text, beginning-of-text and unknown."""
    ids = {*tokenizer.control_tokens().values(), tokenizer.pad_id, tokenizer.eos_id}
    return sorted(ids | {i for i in (tokenizer.bos_id, tokenizer.unk_id) if i is not None})


class _ByteExactVocabulary:
    """What llguidance's TokenizerWrapper reads: each id's bytes, the special ids, and a tokenize function.
    The function is a greedy longest match over those bytes, not the artifact's own encoder: llguidance
    tokenizes the text a grammar forces, and an encoder that normalizes (a SentencePiece model folding tabs,
    newlines and runs of spaces into one `▁`) would give it tokens that spell other bytes, which the matcher
    then refuses when the model takes them."""

    def __init__(self, tokenizer: Tokenizer, table: llguidance.LLTokenizer) -> None:
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = special_ids(tokenizer)
        specials = set(self.special_token_ids)
        self.tokens = [tokenizer.id_to_piece(i).encode() if i in specials else table.decode_bytes([i])
                       for i in range(tokenizer.vocab_size)]
        self._table = table

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance probes for bytes: text only, as greedy_tokenize takes
            raise TypeError("text only")
        return list(self._table.greedy_tokenize(text))


def engine_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for the artifact's: each id's bytes as the artifact's `tokenizers` file decodes
    them (`engine_tokenizer_file`), the ids that are not text special (llguidance allows a special id nowhere
    inside a grammar, and the end-of-text id only where the grammar may end), and a byte-exact tokenize
    (`_ByteExactVocabulary`)."""
    table = llguidance.LLTokenizer(engine_tokenizer_file(tokenizer), n_vocab=tokenizer.vocab_size,
                                   eos_token=tokenizer.eos_id)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteExactVocabulary(tokenizer, table)),
                                  n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_id)


def engine_tokenizer_file(tokenizer: Tokenizer) -> str:
    """The artifact tokenizer's `tokenizers` file (every kind has one, with the same ids) with each id that is
    not text marked special (`special_ids`); unmarked, the byte tokenizer's `<pad>` and `</s>` would read as
    those five characters, which fit inside any JSON string."""
    data = json.loads(tokenizer.to_hf().to_str())
    ids = special_ids(tokenizer)
    added = {entry["id"]: entry for entry in data.setdefault("added_tokens", [])}
    for token_id in ids:
        if token_id in added:
            added[token_id]["special"] = True
        else:
            data["added_tokens"].append({"id": token_id, "content": tokenizer.id_to_piece(token_id),
                                         "single_word": False, "lstrip": False, "rstrip": False,
                                         "normalized": False, "special": True})
    return json.dumps(data, ensure_ascii=False)


def _stops_at_once(matcher: llguidance.LLMatcher) -> bool:
    """Whether the grammar allows no token at its start but the end of text (llguidance finds out when it first
    computes a mask: on a copy, the pristine matcher stays unused)."""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    return bool(probe.is_stopped())


class GrammarCompiler:
    """Compiles constraints for one tokenizer, on its own threads, with the bounds above."""

    def __init__(self, tokenizer: Tokenizer, *, cache_entries: int = 256, timeout_s: float = 10.0,
                 max_source_bytes: int = 65536, threads: int = 2,
                 on_compiled: Callable[[float], None] | None = None,
                 on_refused: Callable[[RefusalReason], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.cache_entries = cache_entries
        self.timeout_s = timeout_s
        self.max_source_bytes = max_source_bytes
        self.on_compiled = on_compiled or (lambda seconds: None)
        self.on_refused = on_refused or (lambda reason: None)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()  # the cache's
        self._tokenizer_lock = threading.Lock()  # building llguidance's tokenizer (a large vocabulary: ~1 s)
        self._cache: OrderedDict[str, CompiledGrammar | Refusal] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the artifact's tokenizer, built once (`engine_tokenizer`)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = engine_tokenizer(self.tokenizer)
            return self._ll_tokenizer

    def holds(self, source: ConstraintSource) -> bool:
        """Whether the cache has the source's result (compiled or refused)."""
        with self._lock:
            return source.key in self._cache

    def cached(self, source: ConstraintSource) -> CompiledGrammar | None:
        """The compiled grammar when the cache has it (a cached refusal is raised again)."""
        with self._lock:
            entry = self._cache.get(source.key)
            if entry is None:
                return None
            self._cache.move_to_end(source.key)
        if isinstance(entry, tuple):
            self._refuse(source, *entry)
        return entry

    async def compile(self, source: ConstraintSource) -> CompiledGrammar:
        """From the event loop: the cached grammar, or one compiled on the grammar threads within timeout_s."""
        hit = self.cached(source)
        if hit is not None:
            return hit
        self._check_size(source)
        future = asyncio.wrap_future(self._pool.submit(self._compile, source))
        try:
            return self._answer(source, await asyncio.wait_for(asyncio.shield(future), self.timeout_s))
        except TimeoutError:
            # the thread cannot be stopped: its result is cached when it ends (as refused if it took too long)
            self._refuse(source, "timeout", self._too_slow())

    def compile_now(self, source: ConstraintSource) -> CompiledGrammar:
        """On the calling thread (tests, benchmarks): compile, cache and return, or raise ValidationFailed
        naming the construct the engine refused."""
        hit = self.cached(source)
        if hit is not None:
            return hit
        self._check_size(source)
        return self._answer(source, self._compile(source))

    def _answer(self, source: ConstraintSource, result: CompiledGrammar | Refusal) -> CompiledGrammar:
        if isinstance(result, tuple):
            self._refuse(source, *result)
        self.on_compiled(result.compile_s)
        return result

    def _compile(self, source: ConstraintSource) -> CompiledGrammar | Refusal:
        """Compile and cache the result, a grammar or a refusal (never raised here: nobody may be waiting)."""
        began = time.perf_counter()
        tokenizer = self.ll_tokenizer()
        result: CompiledGrammar | Refusal
        try:
            text = grammar_text(source)
        except ValueError as err:
            result = ("invalid", str(err))
        else:
            matcher = llguidance.LLMatcher(tokenizer, text, limits=llguidance.LLParserLimits(**_LIMITS))
            took = time.perf_counter() - began
            if matcher.is_error():
                result = ("invalid", matcher.get_error())
            elif _stops_at_once(matcher):
                # complete before any token: no text can match (`{"$ref": "#"}`), or only the empty one; a
                # sequence would have nothing to sample but the end-of-text its matcher no longer takes
                result = ("invalid", "no text matches it (or only the empty text)")
            elif took > self.timeout_s:
                result = ("timeout", self._too_slow())
            else:
                result = CompiledGrammar(source.kind, source.key, matcher, took)
        self._remember(source, result)
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _too_slow(self) -> str:
        return f"compiling it takes longer than the server's limit of {self.timeout_s:g} s"

    def _check_size(self, source: ConstraintSource) -> None:
        size = len(source.text.encode("utf-8", errors="surrogatepass"))
        if size > self.max_source_bytes:
            self._refuse(source, "too_large", f"it is {size} bytes; the server's limit is {self.max_source_bytes}")

    def _remember(self, source: ConstraintSource, entry: CompiledGrammar | Refusal) -> None:
        with self._lock:
            self._cache[source.key] = entry
            self._cache.move_to_end(source.key)
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)

    def _refuse(self, source: ConstraintSource, reason: RefusalReason, detail: str) -> NoReturn:
        self.on_refused(reason)
        what = source.kind.replace("_", " ")
        raise ValidationFailed(f"{source.field}: the {what} cannot be used for structured output: {detail}",
                               param=source.field)
