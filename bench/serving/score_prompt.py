"""A long document's prompt logprobs through /v1/completions (`echo`, `logprobs`, `max_tokens` 0) under each
prefill, against the model's own reading of the same tokens in-process: the one-piece prefill against the
one-piece forward, the causal prefill (REFORMER_PREFILL=causal, the CPU default) against the extend's logits at
every token (`Decoder.extend(..., all_logits=True)`, equal to one decode step per token). For each: tokens per
second of both sides, their ratio, and the largest difference of the per-token logprobs (0.0: the same bits);
and the causal request's time over the one-piece request's, both taken in this run.

    python bench/serving/score_prompt.py [ARTIFACT] [--tokens 64000] [--text FILE] \
        [--out bench/results/score_prompt.json]

The document is FILE's bytes (default: this repository's Python sources) repeated to `--tokens` tokens. The
service runs in-process (create_app with the artifact, one request through its HTTP layer), so both sides run
on the same threads; the request's time includes JSON encoding of every token's logprob."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from fastapi.testclient import TestClient  # noqa: E402

from export import load_artifact  # noqa: E402
from model.decoding import DecodeCache  # noqa: E402
from model.decoding.extend import open_indexes  # noqa: E402
from model.decoding.step import Decoder  # noqa: E402
from service.api.app import create_app  # noqa: E402
from service.settings import Settings  # noqa: E402


def document(tokenizer: object, path: Path | None, tokens: int) -> list[int]:
    text = path.read_text(errors="replace") if path else "".join(p.read_text() for p in sorted(REPO.glob("*/*.py")))
    ids: list[int] = tokenizer.encode(text)  # type: ignore[attr-defined]
    while len(ids) < tokens:
        ids += ids
    return ids[:tokens]


def reference(artifact: object, ids: list[int], prefill: str) -> tuple[Tensor, float]:
    """The logprob of each token after the first as the prefill `prefill` reads the prompt in-process, and the
    seconds it took: the one-piece forward, or the causal extend's per-token logits in 1,024-token calls (what
    the service's scored slices read)."""
    lm = artifact.model  # type: ignore[attr-defined]
    targets = torch.tensor(ids[1:]).unsqueeze(-1)  # (L-1, 1)
    began = time.perf_counter()
    with torch.inference_mode():
        if prefill == "one-piece":
            logits = lm(torch.tensor([ids])).logits[0, :-1].float()  # (L-1, vocab)
            out = torch.log_softmax(logits, -1).gather(-1, targets).squeeze(-1)
        else:
            cache = DecodeCache.for_tokens(lm, len(ids) + 1)
            decoder = Decoder(lm, cache)
            state = cache.allocate(len(ids) + 1)
            open_indexes(decoder, state)
            parts = []
            for a in range(0, len(ids) - 1, 1024):
                z = min(a + 1024, len(ids) - 1)
                logits = decoder.extend(state, ids[a:z], all_logits=True).float()  # (z-a, vocab)
                parts.append(torch.log_softmax(logits, -1).gather(-1, targets[a:z]).squeeze(-1))
            out = torch.cat(parts)
    return out, time.perf_counter() - began


def served(artifact: object, ids: list[int], prefill: str) -> tuple[Tensor, float]:
    """The same logprobs through the service with REFORMER_PREFILL=`prefill`, and the request's seconds."""
    settings = Settings(max_input_tokens=len(ids), max_new_tokens=16, max_wait_ms=0,  # type: ignore[call-arg]
                        log_level="warning", prefill=prefill, prefix_cache=False)  # type: ignore[arg-type]
    with TestClient(create_app(settings, artifact)) as client:  # type: ignore[arg-type]
        while client.get("/ready").status_code != 200:
            time.sleep(0.1)
        began = time.perf_counter()
        r = client.post("/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
        seconds = time.perf_counter() - began
        r.raise_for_status()
        runs = client.get("/info").json()["batching"]["prefill"]
    if runs != prefill:
        raise SystemExit(f"asked for the {prefill} prefill, the server ran {runs}")
    return torch.tensor(r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", nargs="?", default=str(REPO / "export" / "default_artifact"))
    p.add_argument("--tokens", type=int, default=64000)
    p.add_argument("--text", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    artifact = load_artifact(Path(args.artifact))
    ids = document(artifact.tokenizer, args.text, args.tokens)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result: dict[str, object] = {"benchmark": "score_prompt", "artifact": Path(args.artifact).name,
                                 "tokens": len(ids), "threads": torch.get_num_threads(), "commit": commit,
                                 "load_1min_before": os.getloadavg()[0]}
    for prefill in ("one-piece", "causal"):
        expected, in_process_s = reference(artifact, ids, prefill)
        got, service_s = served(artifact, ids, prefill)
        result[prefill] = {
            "in_process_s": round(in_process_s, 3), "in_process_tokens_per_s": round(len(ids) / in_process_s, 1),
            "service_s": round(service_s, 3), "service_tokens_per_s": round(len(ids) / service_s, 1),
            "service_over_in_process": round(in_process_s / service_s, 3),
            "max_abs_logprob_difference": float((got - expected).abs().max()),
        }
    arms = {k: result[k] for k in ("one-piece", "causal")}
    result["causal_over_one_piece_service_s"] = round(
        arms["causal"]["service_s"] / arms["one-piece"]["service_s"], 3)  # type: ignore[index]
    result["load_1min_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))
    print(f"{len(ids)} tokens; load {result['load_1min_before']:.2f} before, {result['load_1min_after']:.2f} after")
    print(f"{'prefill':<10} {'in-process s':>12} {'service s':>10} {'tokens/s':>9} {'max |diff|':>11}")
    for name, arm in arms.items():
        print(f"{name:<10} {arm['in_process_s']:>12.3f} {arm['service_s']:>10.3f} "  # type: ignore[index]
              f"{arm['service_tokens_per_s']:>9.0f} {arm['max_abs_logprob_difference']:>11.3g}")  # type: ignore[index]
    print(f"causal / one-piece request time: {result['causal_over_one_piece_service_s']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
