"""Tokenizing off the event loop. Turning a request's text into token ids (and the chat template's rendering,
the ids' text for /detokenize, /tokenize's whole answer) is CPU work proportional to the body, up to
max_payload_bytes: on the event loop a 4 MB /tokenize held every stream and /health for seconds. It runs on a
small pool of threads instead, so at most `threads` bodies are tokenized at once and the rest wait their turn
without holding the loop (a Python tokenizer still shares the GIL with the loop, which then gets it back at
every switch interval; Rust and C tokenizers release it)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


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
