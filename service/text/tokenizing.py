"""Tokenizing off the event loop. Turning a request's text into token ids (and the chat template's rendering,
the ids' text for /detokenize, /tokenize's whole answer) is CPU work proportional to the body, up to
max_payload_bytes: on the event loop a 4 MB /tokenize held every stream and /health for seconds. It runs on a
small pool of threads instead, so at most `threads` bodies are tokenized at once and the rest wait their turn
without holding the loop (a Python tokenizer still shares the GIL with the loop, which then gets it back at
every switch interval; Rust and C tokenizers release it). A large answer is rendered in slices for the same
reason (`json_array`)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


# items per json.dumps call in `json_array`: one call holds the GIL throughout
JSON_SLICE = 8192


def json_array(values: list[Any]) -> list[bytes]:
    """`values` as compact JSON (the bytes Starlette's JSONResponse renders), in pieces of JSON_SLICE items.
    One json.dumps of a 4M-token answer held the GIL, and so the event loop, for 2.4 s even from another
    thread; between slices the loop gets it back, and the pieces go out one by one instead of as one 50 MB
    buffer copied on the loop."""
    pieces = [b"["]
    for start in range(0, len(values), JSON_SLICE):
        text = json.dumps(values[start:start + JSON_SLICE], ensure_ascii=False, allow_nan=False,
                          separators=(",", ":"))
        pieces.append((("," if start else "") + text[1:-1]).encode())
    pieces.append(b"]")
    return pieces


def release_in_slices(values: list[Any]) -> None:
    """Empty `values` a slice at a time: freeing a list of millions of strings is one call that holds the GIL
    (0.26 s for a 4M-token answer's token strings, at the end of the thread's work)."""
    while values:
        del values[-JSON_SLICE * 8:]


class Tokenizing:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reformer-tokenize")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """fn(*args, **kwargs) on the pool, with the caller's context (its request id in log lines); its
        exception (a 4xx naming the input) is raised here."""
        context = contextvars.copy_context()
        call = functools.partial(context.run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def shutdown(self) -> None:
        """No new work; what waits for a thread is dropped (the server is stopping)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
