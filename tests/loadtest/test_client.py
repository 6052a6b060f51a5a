"""loadtest/client.py: the closed loop holds its concurrency, the open loop keeps its rate."""

from __future__ import annotations

import asyncio

from loadtest.client import Bound, RequestRecord, closed_loop, open_loop
from loadtest.documents import Document


def test_closed_loop_holds_exactly_its_concurrency_and_sends_the_bounded_count() -> None:
    docs = _documents(5)
    in_flight, peak, sent = 0, 0, []
    full = asyncio.Event()

    async def send(doc: Document) -> RequestRecord:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        sent.append(doc)
        if in_flight == 3:
            full.set()
        await full.wait()  # nobody is answered before three are in flight together
        await asyncio.sleep(0)
        in_flight -= 1
        return RequestRecord("embed", 200, 0.0, 0.0)

    records, _ = asyncio.run(closed_loop(send, docs, 3, Bound(requests=7), lambda _r: None))
    assert len(records) == len(sent) == 7 and peak == 3
    assert sent == docs + docs[:2]  # documents are taken in turn, round and round


def test_open_loop_keeps_sending_while_earlier_requests_are_unanswered() -> None:
    docs = _documents(2)
    answer = asyncio.Event()
    issued = 0

    async def send(doc: Document) -> RequestRecord:
        nonlocal issued
        issued += 1
        if issued == 5:
            answer.set()
        await answer.wait()  # a closed loop would deadlock here; an open loop sends all five first
        return RequestRecord("generate", 200, 0.0, 0.0)

    records, _ = asyncio.run(open_loop(send, docs, 1000.0, Bound(requests=5), lambda _r: None))
    assert len(records) == 5


def _documents(count: int) -> list[Document]:
    return [Document(source="book.txt", text=f"document {i}") for i in range(count)]
