"""What `n` choices of one long prompt hold in the decode cache, and their time to first token, through the engine
in-process on the shipped model: n=1, n=4 with forks sharing the leader's prompt blocks (the default,
model/decoding/cache.py `DecodeCache.fork`), and n=4 with forks holding copies (PromptReuse.share_blocks off,
the path before), on one engine, the arms interleaved repeat by repeat. Ratios are taken in one run, against n=1.

    python bench/serving/fork_memory.py [ARTIFACT] [--prompt-tokens 16384] [--new 16] [--repeats 5]
                                        [--test-books DIR] [--out FILE]

The prompt is the first --prompt-tokens tokens of the first whole book of --test-books (bench/unseen_books.py;
without it, or when that book is shorter, seeded random tokens). Each choice samples with its own seed
(choice i: seed i), so n=4's choices differ; the bench checks that the two n=4 arms give the same tokens. The
cache is measured after every allocation and fork (its peak): `cache_bytes` is DecodeCache.allocated_bytes
(a shared block counted once; each request's slot included), `prompt_bytes` the blocks alone (keys, values, key
factors and orders: each block in use, plus the spare order blocks forks use). TTFT is the time from submitting
the n requests to the last of their first tokens: the best and the median of --repeats. Writes
bench/results/fork_memory.json and prints a table with the 1-minute load before and after."""

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
from bench.serving.arms_io import print_arms, prompt_ids, ratios_to, result  # noqa: E402
from bench.unseen_books import add_test_books_arg  # noqa: E402
from export import load_artifact  # noqa: E402
from model.sampling import SamplingParams  # noqa: E402
from service.engine.core import Engine, EngineConfig  # noqa: E402
from service.jobs import GenerationSpec  # noqa: E402
from service.observability.metrics import ServiceMetrics  # noqa: E402


class Peak:
    """The cache's peak after every allocation and fork (wrapping the cache's own methods)."""

    def __init__(self, engine: Engine) -> None:
        self.cache = cache = engine.runner.cache
        self.bytes = self.prompt_bytes = self.blocks = 0
        allocate, fork = cache.allocate, cache.fork

        def allocating(*args: Any, **kwargs: Any) -> Any:
            out = allocate(*args, **kwargs)
            self.note()
            return out

        def forking(*args: Any, **kwargs: Any) -> None:
            fork(*args, **kwargs)
            self.note()

        cache.allocate, cache.fork = allocating, forking  # type: ignore[method-assign]

    def note(self) -> None:
        c = self.cache
        blocks = c.blocks - 1 - c.free_blocks
        spares = c.blocks - 1 - c.free_spare_orders
        self.blocks = max(self.blocks, blocks)
        self.bytes = max(self.bytes, c.allocated_bytes)
        self.prompt_bytes = max(self.prompt_bytes, blocks * c.bytes_per_block + spares * c.order_bytes_per_block)

    def reset(self) -> None:
        self.bytes = self.prompt_bytes = self.blocks = 0


async def _choices(engine: Engine, specs: list[GenerationSpec]) -> tuple[float, list[list[int]]]:
    began = time.perf_counter()
    firsts: list[float] = []

    async def one(spec: GenerationSpec) -> list[int]:
        stream = engine.generate(spec)
        ids: list[int] = []
        while True:
            event = await stream.next_event()
            if not ids:
                firsts.append(time.perf_counter() - began)
            ids.append(event.id)
            if event.finish is not None:
                return ids

    out = list(await asyncio.gather(*(one(s) for s in specs)))
    return max(firsts), out


def run_arms(artifact: Any, prompt: list[int], new: int, repeats: int) -> dict[str, dict[str, Any]]:
    """The three arms on one engine (forks' sharing switched between them), interleaved repeat by repeat, so a
    change of the machine's load falls on every arm."""
    config = EngineConfig(warmup=False, max_request_tokens=len(prompt) + new)
    engine = Engine(artifact.model, artifact.tokenizer, backend=None, device=None,  # type: ignore[arg-type]
                    config=config, metrics=ServiceMetrics())
    peak = Peak(engine)
    engine.start()
    arms = {"n1": (1, True), "n4_shared": (4, True), "n4_copied": (4, False)}
    out: dict[str, dict[str, Any]] = {name: {"n": n, "shared_blocks": shared, "ttft_all_s": []}
                                      for name, (n, shared) in arms.items()}
    specs = [GenerationSpec(prompt_ids=prompt, sampling=SamplingParams(do_sample=True, seed=i), max_new_tokens=new,
                            stop_on_eos=False) for i in range(4)]
    try:
        asyncio.run(_choices(engine, specs[:1]))  # warm: the kernels, the pools' first pages
        for _ in range(repeats):
            for name, (n, shared) in arms.items():
                engine.generations.reuse.share_blocks = shared  # read when a job is sorted: the engine is idle
                peak.reset()
                seconds, tokens = asyncio.run(_choices(engine, specs[:n]))
                arm = out[name]
                arm["ttft_all_s"].append(seconds)
                arm.update(cache_bytes=peak.bytes, prompt_bytes=peak.prompt_bytes, blocks=peak.blocks, tokens=tokens)
    finally:
        engine.stop()
    for arm in out.values():
        arm["ttft_s"] = min(arm["ttft_all_s"])
        arm["ttft_median_s"] = statistics.median(arm["ttft_all_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", nargs="?", default=str(REPO / "export" / "default_artifact"))
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    add_test_books_arg(ap)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fork_memory.json")
    args = ap.parse_args()
    artifact = load_artifact(Path(args.artifact))
    prompt, source = prompt_ids(artifact, args.prompt_tokens, args.test_books)
    load_before = os.getloadavg()[0]
    arms = run_arms(artifact, prompt, args.new, args.repeats)
    load_after = os.getloadavg()[0]
    if arms["n4_shared"]["tokens"] != arms["n4_copied"]["tokens"]:
        raise SystemExit("n=4 shared and copied gave different tokens")
    if arms["n4_shared"]["tokens"][0] != arms["n1"]["tokens"][0]:
        raise SystemExit("n=4's first choice differs from n=1")
    ratios = ratios_to(arms, "n1", ("cache_bytes", "prompt_bytes", "blocks", "ttft_s", "ttft_median_s"))
    out = result(args, arms, ("ratios_to_n1", ratios), (load_before, load_after), prompt=source,
                 prompt_tokens=len(prompt), new_tokens=args.new)
    write_json(args.out, out)
    print(f"prompt {len(prompt)} tokens ({source}), {args.new} new, best of {args.repeats}; "
          f"load {load_before:.2f} before, {load_after:.2f} after")
    print_arms(arms, ratios, "n1", [("cache_bytes", "cache MB", 2**20, ".1f"),
                                    ("prompt_bytes", "prompt MB", 2**20, ".1f"),
                                    ("blocks", "blocks", 1, ".0f"), ("ttft_s", "TTFT s", 1, ".2f"),
                                    ("ttft_median_s", "median s", 1, ".2f")])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
