"""Structured output on the served model (issue 65): does every answer match its schema, which schemas compile,
what compiling costs, and what a JSON-schema constraint costs a decode step.

(a) answers: each schema of bench/serving/structured_schemas.json.gz (240: Kubernetes object schemas from the
    `kubernetes-validate` package and written ones; bench/serving/structured_corpus.py says which) that the
    engine compiles is sent to a loopback server's /v1/completions as `guided_json`, sampled with its own seed;
    every answer that finished (finish_reason stop) must parse and validate with `jsonschema` (formats checked);
    the others ended at max_tokens inside the structure (length). Coverage: the schemas the engine compiles
    under the service's default limits, and why the others are refused.
(c) compile time: each schema compiled once (never from the cache) in this process, for the artifact's
    tokenizer, as the service compiles it; p50/p99/max over those that compile.
(b) decode step: batches of 1 and 8 greedy requests generating `--steps` tokens (end of text banned by
    logit_bias, so every request runs every step), in rotating order over `--rounds` rounds: unconstrained;
    constrained by a JSON schema whose one string is longer than the budget (`json_schema`: the real use, but
    its tokens differ from the unconstrained ones, and this model's step time depends on the tokens it reads);
    and constrained by a regex every valid UTF-8 text matches (`any_text`: the same tokens as unconstrained
    wherever the greedy choice is valid UTF-8, so its ratio is the constraint machinery's own cost). The mean
    inter-token latency from the server's histogram (reformer_inter_token_latency_seconds), the median over
    rounds, its ratio to unconstrained, and the mean mask time per batch (reformer_structured_mask_seconds).

    python bench/serving/structured_output.py [--artifact DIR] [--max-tokens 160] [--steps 64] [--rounds 3]
        [--concurrency 8] [--limit N] [--out bench/results/structured_output_<date>.json]

The 1-minute load average before and after is recorded beside the figures: compare ratios from one run only.
tests/bench/serving/test_structured_output.py runs a short form on the tiny test model.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the tree's packages are importable
    sys.path.insert(0, str(REPO))

from bench.server_process import ServerProcess, service_argv  # noqa: E402
from bench.serving.chaos_clients import metric_sum  # noqa: E402
from bench.serving.structured_corpus import read_corpus  # noqa: E402

PROMPT = "The record, as JSON:\n"
# one string longer than any step budget here: a constrained request runs its whole budget, as an ignore_eos one
LONG = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100000}}, "required": ["text"]}
MAX_SCHEMA_BYTES = 65536  # the service's default REFORMER_STRUCTURED_MAX_BYTES


def compile_all(tokenizer: Any, schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each schema compiled once, as the service does (size limit, llguidance's limits): seconds, or why not."""
    from service.errors import ValidationFailed
    from service.text.structured import ConstraintSource, GrammarCompiler

    compiler = GrammarCompiler(tokenizer, cache_entries=1, timeout_s=60.0, max_source_bytes=MAX_SCHEMA_BYTES)
    compiler.ll_tokenizer()  # built once per server: not part of any schema's time
    out = []
    for entry in schemas:
        source = ConstraintSource.schema(entry["schema"], "guided_json")
        began = time.perf_counter()
        try:
            compiler.compile_now(source)
            out.append({"id": entry["id"], "compiled": True, "seconds": time.perf_counter() - began})
        except ValidationFailed as err:
            out.append({"id": entry["id"], "compiled": False, "why": err.message.split(": ", 2)[-1][:200]})
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def check_answer(schema: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    choice = body["choices"][0]
    result: dict[str, Any] = {"finish_reason": choice["finish_reason"], "tokens": body["usage"]["completion_tokens"]}
    if choice["finish_reason"] != "stop":
        return result
    try:
        value = json.loads(choice["text"])
        validator = jsonschema.validators.validator_for(schema)
        validator(schema, format_checker=validator.FORMAT_CHECKER).validate(value)
        result["valid"] = True
    except (ValueError, jsonschema.ValidationError) as err:
        result["valid"] = False
        result["error"] = str(err).splitlines()[0][:200]
        result["text"] = choice["text"][:500]
    return result


async def answer_all(url: str, schemas: list[dict[str, Any]], max_tokens: int, concurrency: int
                     ) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, i: int, entry: dict[str, Any]) -> dict[str, Any]:
        async with gate:
            r = await client.post(url + "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
                "guided_json": entry["schema"]})
        if r.status_code != 200:
            return {"id": entry["id"], "status": r.status_code, "error": r.text[:200]}
        return {"id": entry["id"], "status": 200, **check_answer(entry["schema"], r.json())}

    async with httpx.AsyncClient(timeout=600) as client:
        return list(await asyncio.gather(*(one(client, i, e) for i, e in enumerate(schemas))))


CONDITIONS: dict[str, dict[str, Any]] = {"unconstrained": {}, "json_schema": {"guided_json": LONG},
                                         "any_text": {"guided_regex": "(?s:.*)"}}


async def timed_batch(url: str, batch: int, steps: int, condition: str, eos_id: int) -> dict[str, Any]:
    """`batch` requests of `steps` tokens at once; the server's mean inter-token latency and mask time over them."""
    async with httpx.AsyncClient(timeout=600) as client:
        before = (await client.get(url + "/metrics")).text
        began = time.perf_counter()
        answers = await asyncio.gather(*(client.post(url + "/v1/completions", json={
            "prompt": f"{PROMPT}{i}", "max_tokens": steps, "temperature": 0, "logit_bias": {str(eos_id): -100},
            **CONDITIONS[condition]}) for i in range(batch)))
        wall = time.perf_counter() - began
        after = (await client.get(url + "/metrics")).text
    assert all(a.status_code == 200 and a.json()["usage"]["completion_tokens"] == steps for a in answers), \
        [a.text[:200] for a in answers]

    def delta(name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    name = "reformer_inter_token_latency_seconds"
    masks = delta("reformer_structured_mask_seconds_count")
    return {"itl_s": delta(f"{name}_sum") / max(delta(f"{name}_count"), 1), "wall_s": wall,
            "mask_s": delta("reformer_structured_mask_seconds_sum") / masks if masks else 0.0,
            "texts": [a.json()["choices"][0]["text"] for a in answers]}


async def step_costs(url: str, steps: int, rounds: int, eos_id: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = list(CONDITIONS)
    for batch in (1, 8):
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: drift hits each alike
                runs[name].append(await timed_batch(url, batch, steps, name, eos_id))
        median = {k: statistics.median(x["itl_s"] for x in v) for k, v in runs.items()}
        same = sum(a == b for a, b in zip(runs["any_text"][0]["texts"], runs["unconstrained"][0]["texts"],
                                          strict=True))
        for v in runs.values():
            for x in v:
                del x["texts"]
        out[f"batch_{batch}"] = {
            "runs": runs, "median_itl_s": median,
            "ratio_to_unconstrained": {k: median[k] / median["unconstrained"] for k in names[1:]},
            "median_mask_s_per_batch": {k: statistics.median(x["mask_s"] for x in runs[k]) for k in names[1:]},
            "any_text_same_tokens_as_unconstrained": f"{same}/{batch}",
        }
    return out


def run(artifact: Path | None, *, max_tokens: int, steps: int, rounds: int, concurrency: int, limit: int | None,
        log_dir: Path) -> dict[str, Any]:
    from export import load_artifact

    schemas = read_corpus()[:limit]
    tokenizer = (load_artifact(artifact) if artifact else load_artifact()).tokenizer
    load_before = os.getloadavg()[0]
    compiled = compile_all(tokenizer, schemas)
    ok = {c["id"] for c in compiled if c["compiled"]}
    times = [c["seconds"] for c in compiled if c["compiled"]]
    env = {**os.environ, "REFORMER_LOG_LEVEL": "warning", "REFORMER_MAX_NEW_TOKENS": str(max(max_tokens, steps))}
    with ServerProcess(service_argv(artifact), log_path=log_dir / "server.log", env=env, cwd=REPO) as server:
        server.wait_ready()
        answers = asyncio.run(answer_all(server.url, [s for s in schemas if s["id"] in ok], max_tokens, concurrency))
        steps_report = asyncio.run(step_costs(server.url, steps, rounds, tokenizer.eos_id))
    finished = [a for a in answers if a.get("finish_reason") == "stop"]
    return {
        "date": datetime.date.today().isoformat(), "artifact": str(artifact or "export/default_artifact"),
        "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0],
        "settings": {"max_tokens": max_tokens, "steps": steps, "rounds": rounds, "concurrency": concurrency},
        "coverage": {"schemas": len(schemas), "compiled": len(ok),
                     "refused": [c for c in compiled if not c["compiled"]]},
        "compile_s": {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99), "max": max(times)},
        "answers": {"sent": len(answers), "status_200": sum(a["status"] == 200 for a in answers),
                    "finished": len(finished), "valid": sum(bool(a.get("valid")) for a in finished),
                    "length": sum(a.get("finish_reason") == "length" for a in answers),
                    "invalid": [a for a in finished if not a.get("valid")],
                    "not_200": [a for a in answers if a["status"] != 200]},
        "decode_step": steps_report,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="only the corpus's first N schemas")
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench" / "results" / f"structured_output_{datetime.date.today()}.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="structured_output_"))  # the server's log: not a result
    report = run(args.artifact, max_tokens=args.max_tokens, steps=args.steps, rounds=args.rounds,
                 concurrency=args.concurrency, limit=args.limit, log_dir=log_dir)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    a, c = report["answers"], report["coverage"]
    print(f"coverage {c['compiled']}/{c['schemas']} compiled; compile p50 {report['compile_s']['p50'] * 1e3:.2f} ms "
          f"p99 {report['compile_s']['p99'] * 1e3:.2f} ms; answers: {a['finished']} finished, {a['valid']} valid, "
          f"{a['length']} cut by max_tokens, {len(a['not_200'])} not 200")
    for batch, figures in report["decode_step"].items():
        m, ratio, mask = figures["median_itl_s"], figures["ratio_to_unconstrained"], figures["median_mask_s_per_batch"]
        print(f"{batch}: unconstrained {m['unconstrained'] * 1e3:.2f} ms/token; " + "; ".join(
            f"{k} {m[k] * 1e3:.2f} ms/token, ratio {ratio[k]:.3f}, mask {mask[k] * 1e6:.0f} us/batch" for k in ratio)
            + f"; any_text same tokens {figures['any_text_same_tokens_as_unconstrained']}")
    print(f"load (1 min) {report['load_1min_before']:.2f} -> {report['load_1min_after']:.2f}; wrote {args.out} "
          f"(server log: {log_dir / 'server.log'})")


if __name__ == "__main__":
    main()
