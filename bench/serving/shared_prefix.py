"""Questions about one long document running at once, through the engine in-process on the shipped model under
the causal prefill: what they hold in the decode cache and their time to first token, when a question that
continues from the document's kept state shares the blocks a running request holds of it (the default,
service/engine/live_prefixes.py, model/decoding/cache.py `DecodeCache.share_prefix`) against each holding a
copy (the path before). The arms run on one engine, interleaved repeat by repeat; ratios are taken in one run.

    python bench/serving/shared_prefix.py [ARTIFACT] [--doc-tokens 16384] [--questions 4] [--first-new 64]
                                          [--new 16] [--repeats 5] [--test-books DIR] [--out FILE]

Each repeat empties the prefix cache's memory tier, asks the first question (the document is read cold and its
state kept at its last block boundary), and once the first question's first token is out, while it still
generates its --first-new tokens, asks the other --questions - 1 together: they continue from the kept state
(cut back to the document's last boundary). The document is the first --doc-tokens tokens of the first whole
book of --test-books (bench/unseen_books.py; without it, seeded random tokens). Greedy, so the two arms must
give the same tokens (checked). The cache is measured after every allocation, fork and share (its peak):
`blocks` in use and `prompt_bytes` (each block in use, plus the spare order blocks sharers use). `ttft_s` is the
time from submitting the later questions to the last of their first tokens: the best and the median of
--repeats. Writes bench/results/shared_prefix.json and prints a table with the 1-minute load before and
after."""

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
from bench.serving.fork_memory import Peak  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from service.engine.core import Engine  # noqa: E402
from service.jobs import GenerationSpec  # noqa: E402


async def _ask(engine: Engine, first: GenerationSpec, later: list[GenerationSpec]
               ) -> tuple[float, list[list[int]]]:
    """The first question, then the later ones together once its first token is out; the seconds from
    submitting the later ones to the last of their first tokens, and every question's tokens."""
    firsts: list[float] = []
    began = [0.0]
    first_token = asyncio.Event()

    async def one(spec: GenerationSpec, timed: bool) -> list[int]:
        stream = engine.generate(spec)
        ids: list[int] = []
        while True:
            event = await stream.next_event()
            if not ids:
                if timed:
                    firsts.append(time.perf_counter() - began[0])
                else:
                    first_token.set()
            ids.append(event.id)
            if event.finish is not None:
                return ids

    async def later_ones() -> list[list[int]]:
        await first_token.wait()
        began[0] = time.perf_counter()
        return list(await asyncio.gather(*(one(s, True) for s in later)))

    head, rest = await asyncio.gather(one(first, False), later_ones())
    return max(firsts, default=0.0), [head, *rest]


def run_arms(artifact: Any, doc: list[int], questions: list[list[int]], first_new: int, new: int,
             repeats: int) -> dict[str, dict[str, Any]]:
    longest = len(doc) + max(len(q) for q in questions) + max(first_new, new)
    engine = arms_io.causal_engine(artifact, longest)
    reuse = engine.generations.reuse
    live = reuse.live
    assert live is not None and engine.prefix_cache is not None
    peak = Peak(engine)
    cache = engine.runner.cache
    share = cache.share_prefix

    def sharing(*args: Any, **kwargs: Any) -> None:
        share(*args, **kwargs)
        peak.note()

    cache.share_prefix = sharing  # type: ignore[method-assign]
    specs = [GenerationSpec(prompt_ids=doc + q, sampling=SamplingParams(), max_new_tokens=first_new if i == 0 else new,
                            stop_on_eos=False) for i, q in enumerate(questions)]
    arms = {"shared": True, "copied": False}
    out: dict[str, dict[str, Any]] = {name: {"ttft_all_s": []} for name in arms}
    engine.start()
    try:
        asyncio.run(_ask(engine, specs[0], specs[1:2]))  # warm: the kernels, the pools' first pages
        engine.prefix_cache.store.clear()
        peak.reset()
        asyncio.run(_ask(engine, specs[0], []))  # one question alone: what the others are measured against
        one = {"prompt_bytes": peak.prompt_bytes, "blocks": peak.blocks}
        for _ in range(repeats):
            for name, shared in arms.items():
                engine.prefix_cache.store.clear()  # the document is read cold by the first question
                reuse.live = live if shared else None  # read when a job is admitted and sorted: the engine is idle
                peak.reset()
                seconds, tokens = asyncio.run(_ask(engine, specs[0], specs[1:]))
                arm = out[name]
                arm["ttft_all_s"].append(seconds)
                arm.update(prompt_bytes=peak.prompt_bytes, blocks=peak.blocks, tokens=tokens)
    finally:
        engine.stop()
    for arm in out.values():
        arm["ttft_s"] = min(arm["ttft_all_s"])
        arm["ttft_median_s"] = statistics.median(arm["ttft_all_s"])
        arm["blocks_over_one_question"] = arm["blocks"] / one["blocks"]
        arm["prompt_bytes_over_one_question"] = arm["prompt_bytes"] / one["prompt_bytes"]
    out["one_question"] = one
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arms_io.add_document_args(ap, "shared_prefix.json", repeats=5)
    ap.add_argument("--first-new", type=int, default=64, help="tokens the first question generates")
    ap.add_argument("--new", type=int, default=16, help="tokens each later question generates")
    args = ap.parse_args()
    artifact, doc, source, questions = arms_io.document_and_questions(args)
    load_before = os.getloadavg()[0]
    arms = run_arms(artifact, doc, questions, args.first_new, args.new, args.repeats)
    one = arms.pop("one_question")
    load_after = os.getloadavg()[0]
    if arms["shared"]["tokens"] != arms["copied"]["tokens"]:
        raise SystemExit("sharing and copying gave different tokens")
    ratios = arms_io.ratios_to(arms, "copied", ("prompt_bytes", "blocks", "ttft_s", "ttft_median_s"))
    out = arms_io.result(args, arms, ("ratios_to_copied", ratios), (load_before, load_after), document=source,
                 doc_tokens=len(doc), questions=args.questions, first_new_tokens=args.first_new,
                 new_tokens=args.new, one_question=one)
    write_json(args.out, out)
    print(f"document {len(doc)} tokens ({source}), {args.questions} questions, best of {args.repeats}; "
          f"load {load_before:.2f} before, {load_after:.2f} after")
    print(f"one question alone: {one['prompt_bytes'] / 2**20:.1f} MB, {one['blocks']} blocks")
    arms_io.print_arms(arms, ratios, "copied", [("prompt_bytes", "prompt MB", 2**20, ".1f"),
                                        ("prompt_bytes_over_one_question", "x one", 1, ".2f"),
                                        ("blocks", "blocks", 1, ".0f"),
                                        ("ttft_s", "TTFT s", 1, ".3f"), ("ttft_median_s", "median s", 1, ".3f")])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
