"""A long document's prompt logprobs through /v1/completions (`echo`, `logprobs`, `max_tokens` 0: the prefill's
one forward scores it) against the model's own forward over the same tokens in-process: tokens per second of
each, their ratio, and the largest difference of the per-token logprobs.

    python bench/serving/score_prompt.py [ARTIFACT] [--tokens 64000] [--text FILE] \
        [--out bench/results/score_prompt.json]

The document is FILE's bytes (default: this repository's Python sources) repeated to `--tokens` tokens. The
service runs in-process (create_app with the artifact, one request through its HTTP layer), so both sides run
on the same threads; the request's time includes JSON encoding of every token's logprob."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from fastapi.testclient import TestClient  # noqa: E402

from export import load_artifact  # noqa: E402
from service.api.app import create_app  # noqa: E402
from service.settings import Settings  # noqa: E402


def document(tokenizer: object, path: Path | None, tokens: int) -> list[int]:
    text = path.read_text(errors="replace") if path else "".join(p.read_text() for p in sorted(REPO.glob("*/*.py")))
    ids: list[int] = tokenizer.encode(text)  # type: ignore[attr-defined]
    while len(ids) < tokens:
        ids += ids
    return ids[:tokens]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", nargs="?", default=str(REPO / "export" / "default_artifact"))
    p.add_argument("--tokens", type=int, default=64000)
    p.add_argument("--text", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    artifact = load_artifact(Path(args.artifact))
    ids = document(artifact.tokenizer, args.text, args.tokens)

    began = time.perf_counter()
    with torch.inference_mode():
        logits = artifact.model(torch.tensor([ids])).logits[0].float()  # (L, vocab)
        expected = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    forward_s = time.perf_counter() - began
    del logits

    settings = Settings(max_input_tokens=args.tokens, max_new_tokens=16, max_wait_ms=0,  # type: ignore[call-arg]
                        log_level="warning")
    with TestClient(create_app(settings, artifact)) as client:
        while client.get("/ready").status_code != 200:
            time.sleep(0.1)
        began = time.perf_counter()
        r = client.post("/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
        service_s = time.perf_counter() - began
    r.raise_for_status()
    got = torch.tensor(r.json()["choices"][0]["logprobs"]["token_logprobs"][1:])
    result = {
        "benchmark": "score_prompt", "artifact": Path(args.artifact).name, "tokens": len(ids),
        "threads": torch.get_num_threads(),
        "forward_s": round(forward_s, 3), "forward_tokens_per_s": round(len(ids) / forward_s, 1),
        "service_s": round(service_s, 3), "service_tokens_per_s": round(len(ids) / service_s, 1),
        "service_over_forward": round(forward_s / service_s, 3),
        "max_abs_logprob_difference": float((got - expected).abs().max()),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
