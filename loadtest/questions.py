"""`--questions-per-doc K`: each document is asked K different questions, one after the other, as a reader
asks about a contract or a chat resends its history; with `--questions-at-once`, all K at the same time, as
several users asking about a document just shared. Every prompt is the document followed by a question, and
declares the document as its cached part (`cache_prefix_chars` = the document's length in characters) unless
`--no-cache-prefix`: the first question prefills the document, the later ones can restore it from the server's
prefix cache.

Each use of a document starts with a tag of its own (the run's random id and a serial number), so the first
question about it is new to the server even when the same text was sent before: by the warm-up, an earlier
level, an earlier run or another replica sharing the disk tier. The summary splits first and later questions
and adds what the server's prefix cache counted over the level (`/metrics`)."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Callable

from pydantic import BaseModel

from loadtest.client import Bound, RequestRecord, Send
from loadtest.documents import Document
from loadtest.metrics import PrefixCacheDelta
from loadtest.quantiles import Quantiles

QUESTIONS = (
    "who is the first person named above?",
    "where does the passage take place?",
    "what happens at the end of the passage?",
    "name one object mentioned above.",
    "what season is it?",
    "who speaks last?",
    "what does the narrator want?",
    "which place is named first?",
    "what is the mood of the passage?",
    "who is absent from the scene?",
    "what time of day is it?",
    "what was said about money?",
)


def question(index: int) -> str:
    """The index-th question (a number is added once the list runs out, so K questions always differ)."""
    text = QUESTIONS[index % len(QUESTIONS)]
    if index >= len(QUESTIONS):
        text = f"({index // len(QUESTIONS) + 1}) {text}"
    return f"\n\nQuestion: {text}\nAnswer:"


class Tagger:
    """Tags that make each use of a document new to the server: `[loadtest RUN_ID document N]`."""

    def __init__(self, run_id: str | None = None) -> None:
        self.run_id = run_id or secrets.token_hex(4)
        self._serial = itertools.count()

    def next(self) -> str:
        return f"[loadtest {self.run_id} document {next(self._serial)}]\n\n"


def conversation(doc: Document, tag: str, k: int, declare: bool) -> list[Document]:
    """The K prompts about one document: its tagged text and a different question each, all declaring the
    tagged text (in characters, as the server counts `cache_prefix_chars`) as the cached part when `declare`."""
    head = tag + doc.text
    return [Document(doc.source, head + question(i), len(head) if declare else None) for i in range(k)]


async def ask_documents(
    send: Send,
    docs: list[Document],
    k: int,
    concurrency: int,
    bound: Bound,
    on_done: Callable[[RequestRecord], None],
    *,
    declare: bool,
    tagger: Tagger,
    at_once: bool = False,
) -> tuple[list[RequestRecord], float]:
    """`concurrency` workers, each taking the next document (in turn, round and round) and asking its K
    questions one after the other, the next sent when the previous is answered (`at_once`: all K sent
    together, the next document once every one is answered). `bound` counts documents (or seconds: a
    document begun in time is asked all its questions). Returns the records, each with its `question` index,
    and the wall time."""
    records: list[RequestRecord] = []
    begun = 0
    started = time.perf_counter()

    async def worker() -> None:
        nonlocal begun
        while bound.more(begun, started):
            doc = docs[begun % len(docs)]
            begun += 1  # no await between the check and the increment
            prompts = conversation(doc, tagger.next(), k, declare)
            if at_once:
                await asyncio.gather(*(ask(index, prompt) for index, prompt in enumerate(prompts)))
            else:
                for index, prompt in enumerate(prompts):
                    await ask(index, prompt)

    async def ask(index: int, prompt: Document) -> None:
        record = await send(prompt)
        record.question = index
        records.append(record)
        on_done(record)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - started


def documents_bound(bound: Bound, k: int) -> Bound:
    """A level's bound in documents: --requests N is rounded up to whole documents of K questions."""
    if bound.requests is not None:
        return Bound(requests=-(-bound.requests // k))
    return bound


class QuestionGroup(BaseModel):
    """First questions (the document prefilled), later ones (the document restorable), or all of them."""

    requests: int
    ok: int
    ttft_s: Quantiles | None  # streams only
    latency_s: Quantiles | None
    prompt_tokens: int  # answered requests, as the server reported them
    cached_tokens: int  # of those, restored instead of prefilled (the server's cached_tokens)


class QuestionsResult(BaseModel):
    questions_per_doc: int
    at_once: bool = False  # a document's K questions were sent together
    documents: int
    cache_prefix_declared: bool
    first: QuestionGroup
    later: QuestionGroup
    all: QuestionGroup
    saved_prefill_tokens: int  # sum of cached_tokens over every answered request
    saved_fraction: float | None  # saved_prefill_tokens / prompt tokens of the answered requests
    # the server's prefix cache over the level, from /metrics: tokens looked up and restored (by tier)
    server_queries_tokens: float | None
    server_hits_tokens: dict[str, float] | None
    hit_rate: float | None  # hits / queries, in tokens
    ttft_first_over_later: float | None  # mean TTFT of first questions / of later ones


def _group(records: list[RequestRecord]) -> QuestionGroup:
    answered = [r for r in records if r.ok]
    return QuestionGroup(
        requests=len(records),
        ok=len(answered),
        ttft_s=Quantiles.of([r.ttft_s for r in answered if r.ttft_s is not None]),
        latency_s=Quantiles.of([r.latency_s for r in answered]),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in answered),
        cached_tokens=sum(r.cached_tokens or 0 for r in answered),
    )


def summarise_questions(
    records: list[RequestRecord], k: int, declared: bool, server: PrefixCacheDelta | None, at_once: bool = False
) -> QuestionsResult:
    first = _group([r for r in records if r.question == 0])
    later = _group([r for r in records if r.question is not None and r.question > 0])
    every = _group(records)
    ratio = None
    if first.ttft_s is not None and later.ttft_s is not None and later.ttft_s.mean > 0:
        ratio = first.ttft_s.mean / later.ttft_s.mean
    return QuestionsResult(
        questions_per_doc=k,
        at_once=at_once,
        documents=first.requests,
        cache_prefix_declared=declared,
        first=first,
        later=later,
        all=every,
        saved_prefill_tokens=every.cached_tokens,
        saved_fraction=every.cached_tokens / every.prompt_tokens if every.prompt_tokens else None,
        server_queries_tokens=server.queries_tokens if server else None,
        server_hits_tokens=server.hits_tokens if server else None,
        hit_rate=server.hit_rate if server else None,
        ttft_first_over_later=ratio,
    )
