"""Decode weights (REFORMER_DECODE_WEIGHTS): what bfloat16 and int8 weights buy a CPU decode step, and cost.

    python bench/decode/decode_weights.py [--prompt 16384] [--steps 32] [--rounds 3] [--threads 2]
                                   [--artifact DIR] [--data DIR] [--quality-prompt 1024] [--eval-len 256]
                                   [--continuation 96] [--samples 3] [--skip-speed] [--skip-quality]
                                   [--kv-cache-dtype float32|bfloat16|float16]
                                   [--perf int8 [--perf-seconds 5] [--perf-out FILE]] [--skip-floor]

(a) Speed: google/reformer-enwik8's configuration (bench/import_hf/import_hf_enwik8.py's ENWIK8: 12 layers, hidden 1024,
149M parameters) with random weights (torch.manual_seed(8)), one `--prompt`-token prompt prefilled once
(float32: the prefill never reads the decode weights), then `--steps` decode steps of one row on `--threads`
intra-op threads (the one-call C step splits its products between them) for each weight kind in turn,
`--rounds` rounds, so a swing in the machine's speed falls on every kind; the kinds share the cache (each
step adds a position: the last kind's steps run a few dozen positions later, nothing at 16K). The median
step of each kind is reported. `--kv-cache-dtype` keeps the speed run's cached keys and values in that dtype
(REFORMER_KV_CACHE_DTYPE): the step's other large read. After the timed rounds, each kind's floor: a pass of
plain reads over as many bytes as its packed weights on the same threads (bench/decode/stream_read.py, 10 passes, the
median), the least a step that reads every weight once can take on this machine; the table gives the step as
a multiple of it (`--skip-floor`: not measured; the floor needs a C compiler).

(b) Quality, on the shipped model (or `--artifact`'s), over `--samples` held-out windows (the last 5% of each
file of `--data`, as train/data.py holds tails out): teacher-forced bits per byte of `--eval-len` bytes after a
`--quality-prompt`-byte prompt through the cached decode step with each kind's weights (the tokenizer is
bytes: one token a byte), and greedy agreement: float32's greedy continuation of `--continuation` tokens,
then each kind fed the same tokens, counting the steps whose top-1 is float32's.

Writes bench/results/decode_weights.json and prints a table with the load average.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.decode.decode_quality import held_out_windows  # noqa: E402
from bench.decode.stream_read import StreamReader  # noqa: E402
from bench.decode.stream_read import floor as read_floor  # noqa: E402
from bench.import_hf.import_hf_enwik8 import ENWIK8  # noqa: E402
from model import ReformerConfig, ReformerLM  # noqa: E402
from model.decoding import DecodeCache, Decoder, prefill  # noqa: E402
from model.decoding.runtime import tune_cpu_runtime  # noqa: E402
from model.decoding.steps.fused import FusedStep  # noqa: E402
from model.decoding.steps.linear import StepLinears  # noqa: E402
from model.kernels.weights import KINDS, WeightKind  # noqa: E402
from train.corpus_manifest import set_folder  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PERF_STEPS = 2048  # positions reserved for --perf's steps (it stops there)


def use_weights(decoder: Decoder, kind: WeightKind, held: dict[str, tuple[StepLinears, FusedStep]]) -> None:
    """The decoder's C step with `kind` weights (each kind's packings made once and kept in `held`)."""
    if kind not in held:
        linears = StepLinears(decoder.backends.linears.kernel, kind)
        held[kind] = (linears, FusedStep(linears))
    decoder.backends.linears, decoder.backends.fused = held[kind]


@torch.no_grad()
def profile(decoder: Decoder, states: Any, token: torch.Tensor, kind: WeightKind, kv: str,
            held: dict[str, tuple[StepLinears, FusedStep]], seconds: float, out: Path) -> torch.Tensor:
    """`perf record` of this process while it runs `kind` decode steps for `seconds`; the report (self samples
    by library and symbol) goes to `out`. Returns the last token."""
    use_weights(decoder, kind, held)
    data = out.with_suffix(".data")
    rec = subprocess.Popen(["perf", "record", "-F", "1000", "-g", "-o", str(data), "-p", str(os.getpid()), "--",
                            "sleep", str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    times: list[float] = []
    while rec.poll() is None and len(times) < PERF_STEPS:
        t0 = time.perf_counter()
        token = decoder.step(token, states).argmax(-1)
        times.append(time.perf_counter() - t0)
    rec.wait()
    report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "--stdio",
                             "-g", "none", "--percent-limit", "0.2"], capture_output=True, text=True).stdout
    data.unlink(missing_ok=True)
    head = (f"# perf record -F 1000 -g over {len(times)} one-row decode steps ({kind} weights, {kv} cache) of the "
            f"enwik8-shaped model after {states[0].length} positions, {torch.get_num_threads()} threads; median step "
            f"{1000 * statistics.median(times):.2f} ms (perf's own cost included)\n"
            f"# perf report --no-children --sort dso,sym; written by bench/decode/decode_weights.py --perf\n")
    out.write_text(head + "\n".join(line for line in report.splitlines() if line and not line.startswith("#")) + "\n")
    print(f"perf profile: {out}", file=sys.stderr, flush=True)
    return token


def speed(prompt_len: int, steps: int, rounds: int, threads: int, kv: str = "float32",
          perf: tuple[WeightKind, float, Path] | None = None, floor: bool = True) -> dict[str, Any]:
    import transformers

    torch.manual_seed(8)
    lm = ReformerLM(ReformerConfig.from_hf(transformers.ReformerConfig(**ENWIK8))).eval()
    params = sum(p.numel() for p in lm.parameters())
    prompt = torch.randint(3, 258, (prompt_len,))
    total = prompt_len + rounds * len(KINDS) * (steps + 1) + 8 + (PERF_STEPS if perf else 0)
    cache = DecodeCache.for_tokens(lm, total, kv_dtype=getattr(torch, kv))
    decoder = Decoder(lm, cache)
    assert decoder.backends.fused is not None, "the C kernels did not load: nothing to measure"
    start = time.perf_counter()
    first, states = prefill(lm, cache, [prompt], [total])
    prefill_s = time.perf_counter() - start
    print(f"prefill of {prompt_len} tokens: {prefill_s:.1f} s", file=sys.stderr, flush=True)
    held: dict[str, tuple[StepLinears, FusedStep]] = {}
    token = first.argmax(-1)
    times: dict[WeightKind, list[float]] = {k: [] for k in KINDS}
    for r in range(rounds):
        for kind in KINDS:
            use_weights(decoder, kind, held)
            token = decoder.step(token, states).argmax(-1)  # packs on first use; not timed
            for _ in range(steps):
                t0 = time.perf_counter()
                token = decoder.step(token, states).argmax(-1)
                times[kind].append(time.perf_counter() - t0)
            print(f"round {r} {kind}: median {1000 * statistics.median(times[kind][-steps:]):.2f} ms",
                  file=sys.stderr, flush=True)
    if perf is not None:
        token = profile(decoder, states, token, perf[0], kv, held, perf[1], perf[2])
    bytes_of = {k: sum(p.weight.numel() * p.weight.element_size() for p in held[k][0]._packed.values())
                for k in KINDS}
    floors: dict[str, dict[str, Any]] = {}
    if floor:
        reader = StreamReader(threads)
        floors = {k: read_floor(reader, bytes_of[k], 10) for k in KINDS}
    return {"config": "google/reformer-enwik8 (bench/import_hf/import_hf_enwik8.py ENWIK8), random weights, seed 8",
            "parameters": params, "prompt": prompt_len, "steps_per_round": steps, "rounds": rounds,
            "threads": threads, "kv_cache_dtype": kv, "prefill_s": prefill_s,
            "kinds": {k: {"median_ms": 1000 * statistics.median(v), "min_ms": 1000 * min(v),
                          "p90_ms": 1000 * sorted(v)[int(0.9 * (len(v) - 1))], "packed_weight_bytes": bytes_of[k],
                          **({"read_floor": floors[k]} if k in floors else {})}
                      for k, v in times.items()}}


@torch.no_grad()
def quality(artifact: str | None, data: Path, prompt_len: int, eval_len: int, continuation: int,
            samples: int) -> dict[str, Any]:
    from export import load_artifact

    art = load_artifact(artifact) if artifact else load_artifact()
    lm = art.model.eval()
    windows = held_out_windows(data, art.tokenizer, prompt_len + max(eval_len, continuation), samples)
    nats = {k: 0.0 for k in KINDS}
    agree = {k: 0 for k in KINDS}
    counted = 0
    largest = {k: 0.0 for k in KINDS}  # the largest |logit - float32 logit| seen
    for w in windows:
        ids = torch.tensor(w)
        # teacher-forced bits per byte of w[prompt_len : prompt_len + eval_len]
        targets = ids[prompt_len:prompt_len + eval_len]
        for kind in KINDS:
            cache = DecodeCache.for_tokens(lm, prompt_len + eval_len + 1)
            decoder = Decoder(lm, cache, kind)
            first, states = prefill(lm, cache, [ids[:prompt_len]], [prompt_len + eval_len + 1])
            logits = [first[0]]
            for tok in targets[:-1].tolist():
                logits.append(decoder.step(torch.tensor([tok]), states)[0])
            nats[kind] += torch.nn.functional.cross_entropy(torch.stack(logits), targets, reduction="sum").item()
        # greedy agreement: float32's greedy tokens, each kind fed the same ones
        ref_tokens: list[int] = []
        ref_logits: list[torch.Tensor] = []
        for kind in KINDS:
            cache = DecodeCache.for_tokens(lm, prompt_len + continuation + 1)
            decoder = Decoder(lm, cache, kind)
            first, states = prefill(lm, cache, [ids[:prompt_len]], [prompt_len + continuation + 1])
            out = first[0]
            for i in range(continuation):
                if kind == "float32":
                    ref_tokens.append(int(out.argmax()))
                    ref_logits.append(out)
                else:
                    agree[kind] += int(out.argmax()) == ref_tokens[i]
                    largest[kind] = max(largest[kind], (out - ref_logits[i]).abs().max().item())
                if i + 1 < continuation:
                    out = decoder.step(torch.tensor([ref_tokens[i]]), states)[0]
        counted += continuation
    agree["float32"] = counted
    scored = len(windows) * eval_len
    return {"artifact": str(art.path), "samples": len(windows), "prompt": prompt_len, "eval_len": eval_len,
            "continuation": continuation,
            "kinds": {k: {"bits_per_byte": nats[k] / scored / math.log(2), "greedy_agreement": agree[k] / counted,
                          "max_abs_logit_diff": largest[k]} for k in KINDS}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--artifact", default=None, help="artifact for the quality part (default: the shipped model)")
    p.add_argument("--data", type=Path, default=set_folder("data"),
                   help="folder of books (default: corpus/data, written by `reformer data`)")
    p.add_argument("--quality-prompt", type=int, default=1024)
    p.add_argument("--eval-len", type=int, default=256)
    p.add_argument("--continuation", type=int, default=96)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-floor", action="store_true", help="do not measure the memory-read floor (needs cc)")
    p.add_argument("--out", type=Path, default=RESULTS / "decode_weights.json")
    p.add_argument("--perf", default=None, choices=list(KINDS),
                   help="after the timed rounds, `perf record` steps of this kind (needs perf)")
    p.add_argument("--perf-seconds", type=float, default=5.0)
    p.add_argument("--perf-out", type=Path, default=RESULTS / "decode_step_perf.txt")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune_cpu_runtime()
    load_before = os.getloadavg()
    result: dict[str, Any] = {"argv": sys.argv[1:], "load_before": load_before}
    if not args.skip_speed:
        perf = (args.perf, args.perf_seconds, args.perf_out) if args.perf else None
        result["speed"] = speed(args.prompt, args.steps, args.rounds, args.threads, args.kv_cache_dtype, perf,
                                not args.skip_floor)
    if not args.skip_quality:
        result["quality"] = quality(args.artifact, args.data, args.quality_prompt, args.eval_len, args.continuation,
                                    args.samples)
    result["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after "
             f"{result['load_after'][0]:.2f} {result['load_after'][1]:.2f} {result['load_after'][2]:.2f}",
             f"{'weights':<9} {'ms/token':>9} {'min':>7} {'p90':>7} {'packed MB':>10} {'floor ms':>9} "
             f"{'x floor':>8} {'bits/byte':>10} {'greedy agree':>13} {'max |dlogit|':>13}"]
    for kind in KINDS:
        s = result.get("speed", {}).get("kinds", {}).get(kind, {})
        q = result.get("quality", {}).get("kinds", {}).get(kind, {})
        cell = (lambda d, key, fmt: format(d[key], fmt) if key in d else "-")  # noqa: E731
        mb = f"{s['packed_weight_bytes'] / 1e6:.0f}" if s else "-"
        fl = s.get("read_floor", {})
        times_floor = f"{s['median_ms'] / fl['median_ms']:.2f}" if fl else "-"
        lines.append(f"{kind:<9} {cell(s, 'median_ms', '.2f'):>9} {cell(s, 'min_ms', '.2f'):>7} "
                     f"{cell(s, 'p90_ms', '.2f'):>7} {mb:>10} {cell(fl, 'median_ms', '.2f'):>9} {times_floor:>8} "
                     f"{cell(q, 'bits_per_byte', '.4f'):>10} "
                     f"{cell(q, 'greedy_agreement', '.3f'):>13} {cell(q, 'max_abs_logit_diff', '.4f'):>13}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
