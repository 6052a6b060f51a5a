"""Questions about one new document sent at the same time, through the engine in-process on the shipped model under
the causal prefill: their times to first token and the prompt tokens read, when the later questions wait for
the first one's read of the document and continue from its kept state (the default,
service/engine/prefix_readers.py) against each reading the whole document beside the others (the path before).
The arms run on one engine, interleaved repeat by repeat; ratios are taken in one run.

    python bench/serving/document_together.py [ARTIFACT] [--doc-tokens 16384] [--questions 4] [--new 8]
                                              [--repeats 3] [--test-books DIR] [--out FILE]

Each repeat empties the prefix cache's memory tier and submits --questions prompts (the document, then a
question) in one admission turn. The document is the first --doc-tokens tokens of the first whole book of
--test-books (bench/unseen_books.py; without it, seeded random tokens). Greedy, so the two arms must give the
same tokens (checked). `ttft_mean_s` and `ttft_last_s` are the mean and the largest time from submitting to a
question's first token (medians over --repeats); `tokens_read` counts the prompt tokens the extend read.
Writes bench/results/document_together.json and prints a table with the 1-minute load before and after."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.results_io import write_json  # noqa: E402
from bench.serving import arms_io  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from service.engine.core import Engine  # noqa: E402
from service.jobs import GenerationSpec  # noqa: E402


async def _ask_together(engine: Engine, specs: list[GenerationSpec]) -> tuple[list[float], list[list[int]]]:
    """Every spec submitted in one admission turn: each one's seconds to its first token, and its tokens."""
    with engine._cond:  # queued together: one admission turn takes them all
        began = time.perf_counter()
        streams = [engine.generate(spec) for spec in specs]

    async def one(stream: Any) -> tuple[float, list[int]]:
        ids: list[int] = []
        first = 0.0
        while True:
            event = await stream.next_event()
            if not ids:
                first = time.perf_counter() - began
            ids.append(event.id)
            if event.finish is not None:
                return first, ids

    done = await asyncio.gather(*(one(s) for s in streams))
    return [t for t, _ in done], [ids for _, ids in done]


def run_arms(artifact: Any, doc: list[int], questions: list[list[int]], new: int, repeats: int
             ) -> dict[str, dict[str, Any]]:
    longest = len(doc) + max(len(q) for q in questions) + new
    engine = arms_io.causal_engine(artifact, longest, max_batch_size=max(8, len(questions)))
    reuse = engine.generations.reuse
    readers = reuse.readers
    assert readers is not None and engine.prefix_cache is not None
    read = [0]
    extend = engine.runner.extend_slices

    def counting(prompt: Any, reserve: int, state: Any, *args: Any, **kwargs: Any) -> Any:
        read[0] += len(prompt) - (state.length if state is not None else 0)
        return extend(prompt, reserve, state, *args, **kwargs)

    engine.runner.extend_slices = counting  # type: ignore[method-assign,assignment]
    specs = [GenerationSpec(prompt_ids=doc + q, sampling=SamplingParams(), max_new_tokens=new, stop_on_eos=False)
             for q in questions]
    arms = {"wait": True, "read_each": False}
    out: dict[str, dict[str, Any]] = {name: {"ttft_mean_all_s": [], "ttft_last_all_s": []} for name in arms}
    engine.start()
    try:
        asyncio.run(_ask_together(engine, specs[:1]))  # warm: the kernels, the pools' first pages
        for _ in range(repeats):
            for name, wait in arms.items():
                engine.prefix_cache.store.clear()  # the document is new to the server
                reuse.readers = readers if wait else None  # read when a job is sorted: the engine is idle
                read[0] = 0
                firsts, tokens = asyncio.run(_ask_together(engine, specs))
                arm = out[name]
                arm["ttft_mean_all_s"].append(statistics.fmean(firsts))
                arm["ttft_last_all_s"].append(max(firsts))
                arm.update(tokens_read=read[0], tokens=tokens)
    finally:
        reuse.readers = readers
        engine.stop()
    for arm in out.values():
        arm["ttft_mean_s"] = statistics.median(arm["ttft_mean_all_s"])
        arm["ttft_last_s"] = statistics.median(arm["ttft_last_all_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arms_io.add_document_args(ap, "document_together.json", repeats=3)
    ap.add_argument("--new", type=int, default=8, help="tokens each question generates")
    args = ap.parse_args()
    artifact, doc, source, questions = arms_io.document_and_questions(args)
    load_before = os.getloadavg()[0]
    arms = run_arms(artifact, doc, questions, args.new, args.repeats)
    load_after = os.getloadavg()[0]
    if arms["wait"]["tokens"] != arms["read_each"]["tokens"]:
        raise SystemExit("waiting and reading each gave different tokens")
    ratios = arms_io.ratios_to(arms, "read_each", ("ttft_mean_s", "ttft_last_s", "tokens_read"))
    out = arms_io.result(args, arms, ("ratios_to_read_each", ratios), (load_before, load_after), document=source,
                 doc_tokens=len(doc), questions=args.questions, new_tokens=args.new)
    write_json(args.out, out)
    print(f"document {len(doc)} tokens ({source}), {args.questions} questions together, median of {args.repeats}; "
          f"load {load_before:.2f} before, {load_after:.2f} after")
    arms_io.print_arms(arms, ratios, "read_each", [("ttft_mean_s", "TTFT mean s", 1, ".3f"),
                                           ("ttft_last_s", "TTFT last s", 1, ".3f"),
                                           ("tokens_read", "tokens read", 1, ".0f")])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
