"""What the in-process engine benchmarks of bench/serving/ share: their arguments for a document and its questions,
and the result they write (the arms' figures, their ratios to a base arm, the commit, the threads and the load).
Used by shared_prefix.py, document_together.py and fork_memory.py."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path
from typing import Any

import torch

from bench.unseen_books import add_test_books_arg, whole_books
from export import load_artifact
from service.engine.core import Engine, EngineConfig
from service.observability.metrics import ServiceMetrics
from service.prefix_cache import PrefixCacheConfig

REPO = Path(__file__).resolve().parents[2]

QUESTIONS = [" Who is the first person named here, and what do they want?", " Where does this take place?",
             " What happened just before the end of this passage?", " Which words are repeated most?",
             " Summarise the passage in one sentence.", " What season is it?", " Who speaks last?",
             " Name an object that appears twice."]


def prompt_ids(artifact: Any, tokens: int, books: Path | None) -> tuple[list[int], str]:
    """The first `tokens` tokens of the first whole test book, or seeded random tokens without books."""
    if books is not None:
        name, ids = whole_books(books, artifact.tokenizer)[0]
        if len(ids) >= tokens:
            return [int(i) for i in ids[:tokens]], name
    vocab = artifact.model.config.vocab_size
    return torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).tolist(), "random"


def add_document_args(ap: argparse.ArgumentParser, out: str, repeats: int) -> None:
    """ARTIFACT, --doc-tokens, --questions, --repeats, --test-books and --out (bench/results/`out` by default)."""
    ap.add_argument("artifact", nargs="?", default=str(REPO / "export" / "default_artifact"))
    ap.add_argument("--doc-tokens", type=int, default=16384)
    ap.add_argument("--questions", type=int, default=4, choices=range(2, len(QUESTIONS) + 1))
    ap.add_argument("--repeats", type=int, default=repeats)
    add_test_books_arg(ap)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / out)


def document_and_questions(args: argparse.Namespace) -> tuple[Any, list[int], str, list[list[int]]]:
    """The artifact, the document's token ids and where they come from, and the questions' token ids."""
    artifact = load_artifact(Path(args.artifact))
    doc, source = prompt_ids(artifact, args.doc_tokens, args.test_books)
    questions = [list(artifact.tokenizer.encode(q)) for q in QUESTIONS[: args.questions]]
    return artifact, doc, source, questions


def causal_engine(artifact: Any, longest: int, **config: Any) -> Engine:
    """An engine (not started) of the artifact under the causal prefill, a 1 GiB prefix cache, requests up to
    `longest` tokens, and `config`; SystemExit where the causal prefill does not run (it needs the C kernels)."""
    engine = Engine(artifact.model, artifact.tokenizer, backend=None, device=None,  # type: ignore[arg-type]
                    config=EngineConfig(warmup=False, max_request_tokens=longest, prefill="causal",
                                        prefix_cache=PrefixCacheConfig(capacity_bytes=1 << 30), **config),
                    metrics=ServiceMetrics())
    if not engine.causal_prefill:
        raise SystemExit("the causal prefill does not run here (it needs the C kernels)")
    return engine


def ratios_to(arms: dict[str, dict[str, Any]], base: str, keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each arm's figures under `keys` over the `base` arm's."""
    return {name: {key: arm[key] / arms[base][key] for key in keys} for name, arm in arms.items()}


def print_arms(arms: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]], base: str,
               columns: list[tuple[str, str, float, str]]) -> None:
    """A table of the arms: per column (key, header, divisor, format) the arm's figure over the divisor, and beside
    a figure whose key the ratios hold, its ratio to the `base` arm."""
    head = [f"{'arm':<12}"]
    for key, header, _, _ in columns:
        head.append(f"{header:>12}")
        if key in ratios[base]:
            head.append(f"{'x ' + base:>12}")
    print(" ".join(head))
    for name, arm in arms.items():
        cells = [f"{name:<12}"]
        for key, _, divisor, fmt in columns:
            cells.append(format(arm[key] / divisor, f">12{fmt}"))
            if key in ratios[name]:
                cells.append(f"{ratios[name][key]:>12.3f}")
        print(" ".join(cells))


def result(args: argparse.Namespace, arms: dict[str, dict[str, Any]], ratios: tuple[str, dict[str, Any]],
           loads: tuple[float, float], **fields: Any) -> dict[str, Any]:
    """The result file's contents: `fields`, the repeats, the commit, the threads, the 1-minute load before and
    after, the arms (without their tokens, which the caller checked are the same), and `ratios` (name, values)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    return {"artifact": args.artifact, **fields, "repeats": args.repeats, "commit": commit,
            "threads": torch.get_num_threads(), "load_1min_before": loads[0], "load_1min_after": loads[1],
            "arms": {name: {k: v for k, v in arm.items() if k != "tokens"} for name, arm in arms.items()},
            ratios[0]: ratios[1], "same_tokens": True}
