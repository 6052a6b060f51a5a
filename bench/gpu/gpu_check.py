"""The GPU check (bench/gpu/README.md, "GPU check"; run by bench/gpu/gpu_check.sh): the service on CUDA in bf16
and fp32, /generate, /generate_stream and /embed at 1K, 16K and 64K tokens, decode tokens/s at concurrency 1, 8 and
32, every GPU series present and non-zero, the served model's forward tokens/s at 4K/16K/64K against a
full-attention transformer of the same size (scaled_dot_product_attention) on the same GPU, peak memory,
and decode steps replayed as CUDA graphs against eager ones (same logits within 1e-4, time per step).
Writes one JSON file and exits non-zero on any failure or when the time budget runs out.

`--dry-run` runs the same steps on the CPU at tiny sizes, in float32, with the GPU series reported as
absent (the test suite runs it: tests/bench/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: the tree's packages are importable
    sys.path.insert(0, str(REPO))

from bench.server_process import ServerProcess, service_argv  # noqa: E402

GPU_SERIES = (
    "reformer_gpu_memory_allocated_bytes", "reformer_gpu_memory_reserved_bytes",
    "reformer_gpu_memory_peak_allocated_bytes", "reformer_gpu_memory_used_bytes", "reformer_gpu_memory_total_bytes",
    "reformer_gpu_utilization_ratio", "reformer_gpu_process_memory_bytes",
)


@dataclass(frozen=True)
class Sizes:
    request_tokens: tuple[int, ...]
    concurrency: tuple[int, ...]
    forward_tokens: tuple[int, ...]
    decode_prompt: int
    new_tokens: int
    dtypes: tuple[str, ...]
    device: str


GPU = Sizes((1024, 16384, 65536), (1, 8, 32), (4096, 16384, 65536), 256, 64, ("bfloat16", "float32"), "cuda")
DRY = Sizes((64, 128), (1, 2), (128, 256), 32, 4, ("float32",), "cpu")


class Check:
    """Failures and the time budget shared by every step."""

    def __init__(self, budget_s: float):
        self.deadline = time.monotonic() + budget_s
        self.failures: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fail(self, what: str) -> None:
        print(f"gpu_check: FAILED: {what}", flush=True)
        self.failures.append(what)

    def timeout(self, cap: float) -> float:
        if self.left() <= 1:
            raise TimeoutError("the time budget is spent")
        return min(cap, self.left())


def text_of(tokens: int, seed: int = 0) -> str:
    """`tokens` bytes of ASCII prose: one token per byte for the byte-level tokenizer."""
    words = ("the of and to in that was he it his with had for as at by on not be but from which she her all "
             "said were they have one been this you prince river long short window garden night road").split()
    out: list[str] = []
    i = seed
    while sum(len(w) + 1 for w in out) < tokens:
        out.append(words[(i * 7919) % len(words)])
        i += 1
    return " ".join(out)[:tokens]


def parse_metrics(text: str) -> dict[str, float]:
    """Largest sample of each reformer_gpu_* family in a Prometheus text scrape."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(reformer_gpu_\w+)(\{[^}]*\})? (\S+)$", line)
        if match:
            found[match[1]] = max(found.get(match[1], float("-inf")), float(match[3]))
    return found


def start_server(artifact: str | None, device: str, dtype: str, log_path: Path) -> ServerProcess:
    env = {**os.environ, "REFORMER_DEVICE": device, "REFORMER_DTYPE": dtype, "PYTHONUNBUFFERED": "1",
           "REFORMER_MAX_QUEUE_SIZE": "256"}
    return ServerProcess(service_argv(artifact), log_path=log_path, env=env, cwd=REPO)


def one_request(client: httpx.Client, route: str, tokens: int, new_tokens: int, timeout: float) -> dict[str, Any]:
    text = text_of(tokens)
    start = time.perf_counter()
    row: dict[str, Any] = {"route": route, "tokens": tokens}
    if route == "/embed":
        r = client.post(route, json={"inputs": text}, timeout=timeout)
        row["status"] = r.status_code
        if r.status_code == 200:
            row["dimensions"] = len(r.json()[0])
    elif route == "/generate":
        r = client.post(route, json={"inputs": text, "parameters": {"max_new_tokens": new_tokens}}, timeout=timeout)
        row["status"] = r.status_code
        row["generated_tokens"] = int(r.headers.get("x-generated-tokens", 0))
    else:
        body = {"inputs": text, "parameters": {"max_new_tokens": new_tokens}}
        with client.stream("POST", route, json=body, timeout=timeout) as r:
            row["status"] = r.status_code
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        row["events"] = len(events)
    row["seconds"] = round(time.perf_counter() - start, 4)
    if row["status"] != 200:
        row["error"] = r.text[:300] if route != "/generate_stream" else "stream refused"
    return row


async def decode_rate(url: str, concurrency: int, prompt: int, new_tokens: int, timeout: float,
                      scrapes: list[str]) -> dict[str, Any]:
    """`concurrency` generations at once; tokens/s over the wall time; /metrics scraped while they run."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        async def generate(i: int) -> httpx.Response:
            body = {"inputs": text_of(prompt, seed=i), "parameters": {"max_new_tokens": new_tokens}}
            return await client.post("/generate", json=body)

        async def scrape_while_running() -> None:
            await asyncio.sleep(0.2)
            scrapes.append((await client.get("/metrics")).text)

        start = time.perf_counter()
        scraper = asyncio.create_task(scrape_while_running())
        responses = await asyncio.gather(*(generate(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - start
        await scraper
    generated = sum(int(r.headers.get("x-generated-tokens", 0)) for r in responses)
    return {"concurrency": concurrency, "statuses": sorted({r.status_code for r in responses}),
            "generated_tokens": generated, "seconds": round(elapsed, 4),
            "tokens_per_s": round(generated / elapsed, 2)}


def check_service(args: argparse.Namespace, sizes: Sizes, dtype: str, check: Check) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": dtype}
    server = start_server(args.artifact, sizes.device, dtype, args.logs / f"server-{dtype}.log")
    try:
        out["ready_s"] = round(server.wait_ready(check.timeout(180), poll_s=0.25), 2)
        info = httpx.get(server.url + "/info", timeout=10).json()
        out["info"] = {k: info.get(k) for k in ("device", "dtype", "backend", "decode_backend", "version")}
        if info.get("device", "").split(":")[0] != sizes.device:
            check.fail(f"{dtype}: service runs on {info.get('device')}, not {sizes.device}")
        limit = int((info.get("limits") or {}).get("max_input_tokens") or max(sizes.request_tokens))
        rows = []
        with httpx.Client(base_url=server.url) as client:
            for tokens in sizes.request_tokens:
                for route in ("/embed", "/generate", "/generate_stream"):
                    budget = tokens if route == "/embed" else min(tokens, limit - sizes.new_tokens)
                    row = one_request(client, route, min(budget, limit), sizes.new_tokens, check.timeout(120))
                    rows.append(row)
                    print(f"  {dtype} {route:<17} {row['tokens']:>6} tokens: {row['status']} in {row['seconds']} s",
                          flush=True)
                    if row["status"] != 200:
                        check.fail(f"{dtype} {route} at {tokens} tokens answered {row['status']}")
                    elif row.get("generated_tokens", 1) < 1 or row.get("events", 1) < 1:
                        check.fail(f"{dtype} {route} at {tokens} tokens generated nothing")
        out["requests"] = rows
        scrapes: list[str] = []
        out["decode"] = []
        for concurrency in sizes.concurrency:
            rate = asyncio.run(decode_rate(server.url, concurrency, sizes.decode_prompt, sizes.new_tokens,
                                           check.timeout(180), scrapes))
            print(f"  {dtype} decode at concurrency {concurrency}: {rate['tokens_per_s']} tokens/s", flush=True)
            out["decode"].append(rate)
            if rate["statuses"] != [200]:
                check.fail(f"{dtype} decode at concurrency {concurrency}: statuses {rate['statuses']}")
        scrapes.append(httpx.get(server.url + "/metrics", timeout=10).text)
        series: dict[str, float] = {}
        for scrape in scrapes:
            for name, value in parse_metrics(scrape).items():
                series[name] = max(series.get(name, value), value)
        out["gpu_series"] = series
        if sizes.device == "cuda":
            for name in GPU_SERIES:
                if series.get(name, 0) <= 0:
                    check.fail(f"{dtype}: GPU series {name} is {'absent' if name not in series else 'zero'}")
        elif series:
            check.fail(f"GPU series on a CPU run: {sorted(series)}")
    except (RuntimeError, TimeoutError, httpx.HTTPError) as error:
        check.fail(f"{dtype} service: {type(error).__name__}: {error}")
    finally:
        out["exit_code"] = server.stop(45)
        if out["exit_code"] != 0:
            check.fail(f"{dtype}: server exited with {out['exit_code']} after SIGTERM (a clean drain exits 0)")
    return out


def forward_rates(args: argparse.Namespace, sizes: Sizes, check: Check) -> dict[str, Any]:
    """Tokens/s of one forward pass: the served model against full causal attention (SDPA) of its size."""
    import torch
    from torch import nn

    from export import load_artifact

    device = torch.device(sizes.device)
    dtype = getattr(torch, sizes.dtypes[0])
    artifact = load_artifact(args.artifact) if args.artifact else load_artifact()
    cfg = artifact.config
    ours = artifact.model.to(device=device, dtype=dtype).eval()
    heads, head, hidden = cfg.num_attention_heads, cfg.attention_head_size, cfg.hidden_size

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv = nn.Linear(hidden, 3 * heads * head, bias=False)
            self.out = nn.Linear(heads * head, hidden, bias=False)
            self.ff = nn.Sequential(nn.Linear(hidden, cfg.feed_forward_size), nn.ReLU(),
                                    nn.Linear(cfg.feed_forward_size, hidden))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            # (b, t, 3*h*d) -> (3, b, h, t, d)
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, head).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, t, heads * head))  # (b, h, t, d) -> (b, t, h*d)
            return x + self.ff(self.ln2(x))

    layers = len(cfg.attn_layers)
    full = nn.Sequential(nn.Embedding(cfg.vocab_size, hidden), *[Block() for _ in range(layers)],
                         nn.Linear(hidden, cfg.vocab_size)).to(device=device, dtype=dtype).eval()

    def timed(fn: Any, ids: torch.Tensor) -> tuple[float, float | None]:
        fn(ids)  # warm-up: kernels chosen, allocator grown
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            fn(ids)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        peak = round(torch.cuda.max_memory_allocated() / 2**20, 1) if device.type == "cuda" else None
        return best, peak

    rows = []
    with torch.inference_mode():
        for tokens in sizes.forward_tokens:
            check.timeout(60)
            ids = torch.randint(2, cfg.vocab_size, (1, tokens), device=device)
            ours_s, ours_peak = timed(lambda x: ours(x).logits, ids)
            full_s, full_peak = timed(full, ids)
            row = {"tokens": tokens, "reformer_tokens_per_s": round(tokens / ours_s, 1),
                   "sdpa_full_tokens_per_s": round(tokens / full_s, 1), "reformer_over_sdpa": round(full_s / ours_s, 3),
                   "reformer_peak_mib": ours_peak, "sdpa_full_peak_mib": full_peak}
            print(f"  forward {tokens:>6} tokens: reformer {row['reformer_tokens_per_s']:>12} tok/s, "
                  f"SDPA full {row['sdpa_full_tokens_per_s']:>12} tok/s, peak MiB {ours_peak} / {full_peak}",
                  flush=True)
            rows.append(row)
    return {"dtype": sizes.dtypes[0], "device": str(device), "layers": layers, "rows": rows}


def graph_decode(args: argparse.Namespace, sizes: Sizes, check: Check) -> dict[str, Any]:
    """Decode steps of the served model replayed as CUDA graphs (model/decoding/steps/cuda_graphs.py,
    REFORMER_CUDA_GRAPHS)
    against the same steps run eagerly: the logits of every step within 1e-4 (float32), greedy tokens equal,
    graphs actually replayed, and the time per step both ways. The dry run replays by calling the step again
    (the CPU has no graphs), which checks the plumbing only."""
    import torch

    from export import load_artifact
    from model.decoding.steps.cuda_graphs import StepGraphs
    from service.engine.runner import ModelRunner

    device = torch.device(sizes.device)
    artifact = load_artifact(args.artifact) if args.artifact else load_artifact()
    lm = artifact.model.to(device=device, dtype=torch.float32).eval()
    batch, steps = max(sizes.concurrency), sizes.new_tokens * 4
    prompts = [[2 + (7 * i + j) % (lm.config.vocab_size - 2) for j in range(sizes.decode_prompt + 5 * i)]
               for i in range(batch)]
    runs: dict[str, Any] = {}
    for mode in ("eager", "graphs"):
        check.timeout(60)
        graphs = None if mode == "eager" else (StepGraphs() if device.type == "cuda"
                                               else StepGraphs(capture=lambda fn: fn))
        runner = ModelRunner(lm, device, batch, 1 << 30)  # capped at what `batch` requests can use
        runner.graphs = graphs
        logits, states = runner.prefill(prompts, [len(p) + steps + 1 for p in prompts])
        seen, times = [], []
        for _ in range(steps):
            tokens = logits.argmax(-1).tolist()
            start = time.perf_counter()
            logits = runner.decode(tokens, states)  # .cpu() inside: the step has finished
            times.append(time.perf_counter() - start)
            seen.append(logits)
        del runner, states  # the eager run's cache is freed before the graphs run allocates its own
        runs[mode] = {"logits": seen, "ms_per_step": round(1000 * sorted(times[2:])[len(times[2:]) // 2], 3),
                      "replays": graphs.replays if graphs else 0, "captures": graphs.captures if graphs else 0}
    diff = max(float((a - b).abs().max()) for a, b in zip(runs["eager"]["logits"], runs["graphs"]["logits"]))
    same_tokens = all(torch.equal(a.argmax(-1), b.argmax(-1))
                      for a, b in zip(runs["eager"]["logits"], runs["graphs"]["logits"]))
    out = {"batch": batch, "steps": steps, "prompt_tokens": sizes.decode_prompt, "max_abs_diff": diff,
           "same_greedy_tokens": same_tokens,
           **{f"{mode}_{k}": v for mode, run in runs.items() for k, v in run.items() if k != "logits"}}
    print(f"  decode graphs: {out['graphs_replays']} of {steps} steps replayed, max abs diff {diff:.3g}, "
          f"median step {out['eager_ms_per_step']} ms eager, {out['graphs_ms_per_step']} ms graphs", flush=True)
    if diff > 1e-4 or not same_tokens:
        check.fail(f"decode graphs: logits differ from eager steps by {diff:.3g} (same tokens: {same_tokens})")
    if out["graphs_replays"] == 0:
        check.fail("decode graphs: no step was replayed from a graph")
    return out


def half_cache_decode(args: argparse.Namespace, sizes: Sizes, check: Check) -> dict[str, Any]:
    """Greedy decoding of the served model (float32) with its decode cache in float16 and in bfloat16
    (REFORMER_KV_CACHE_DTYPE) against the float32 cache on the same device: the share of steps whose greedy
    token agrees and the largest logit difference until the first disagreement. On CUDA the half pools go
    through PyTorch ops (the C kernel is the CPU's), a path no GPU has run before this check. On the
    shipped model on CPU, 3 rows x 40 steps (a hand measurement): at most 0.075 (float16) and 0.13
    (bfloat16), every token the same; the check fails past 1.0 or under 90% agreement."""
    import torch

    from export import load_artifact
    from service.engine.runner import ModelRunner

    device = torch.device(sizes.device)
    artifact = load_artifact(args.artifact) if args.artifact else load_artifact()
    lm = artifact.model.to(device=device, dtype=torch.float32).eval()
    batch, steps = max(sizes.concurrency), sizes.new_tokens * 4
    prompts = [[2 + (5 * i + 3 * j) % (lm.config.vocab_size - 2) for j in range(sizes.decode_prompt + 7 * i)]
               for i in range(batch)]
    runs: dict[str, list[Any]] = {}
    for name, dtype in (("float32", None), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        check.timeout(60)
        runner = ModelRunner(lm, device, batch, 1 << 30, kv_dtype=dtype)
        logits, states = runner.prefill(prompts, [len(p) + steps + 1 for p in prompts])
        seen = []
        for _ in range(steps):
            seen.append(logits)
            logits = runner.decode(logits.argmax(-1).tolist(), states)
        runs[name] = seen
        del runner, states
    out: dict[str, Any] = {"batch": batch, "steps": steps}
    for name in ("float16", "bfloat16"):
        agree = [bool(torch.equal(a.argmax(-1), b.argmax(-1))) for a, b in zip(runs["float32"], runs[name])]
        until = agree.index(False) if False in agree else len(agree)
        diff = max((float((a - b).abs().max()) for a, b in zip(runs["float32"][:until], runs[name][:until])),
                   default=0.0)
        out[name] = {"agreement": sum(agree) / len(agree), "max_abs_diff_while_agreeing": diff}
        print(f"  decode cache in {name}: greedy agreement {out[name]['agreement']:.0%} of {steps} steps, "
              f"max abs logit diff {diff:.3g} until the first disagreement", flush=True)
        if diff > 1.0 or out[name]["agreement"] < 0.9:
            check.fail(f"decode cache in {name}: agreement {out[name]['agreement']:.0%}, max diff {diff:.3g}")
    return out


def environment(sizes: Sizes) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if sizes.device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as error:  # the driver version is informative only
            env["driver"] = f"unknown ({error})"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, float32 (the test suite's run)")
    parser.add_argument("--artifact", help="artifact to serve (default: the one shipped in the package)")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop and fail past this many seconds")
    args = parser.parse_args(argv)
    sizes = DRY if args.dry_run else GPU
    check = Check(args.budget_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.logs = args.out.parent / (args.out.stem + "_logs")
    args.logs.mkdir(exist_ok=True)
    started = time.monotonic()
    report: dict[str, Any] = {"mode": "dry-run" if args.dry_run else "gpu", "env": environment(sizes)}
    print("gpu_check:", json.dumps(report["env"]), flush=True)
    if sizes.device == "cuda" and not report["env"]["cuda_available"]:
        check.fail("torch sees no CUDA device")
    else:
        report["services"] = [check_service(args, sizes, dtype, check) for dtype in sizes.dtypes]
        try:
            report["forward"] = forward_rates(args, sizes, check)
        except (RuntimeError, TimeoutError) as error:
            check.fail(f"forward: {type(error).__name__}: {error}")
        try:
            report["decode_graphs"] = graph_decode(args, sizes, check)
        except (RuntimeError, TimeoutError) as error:
            check.fail(f"decode graphs: {type(error).__name__}: {error}")
        try:
            report["half_cache_decode"] = half_cache_decode(args, sizes, check)
        except (RuntimeError, TimeoutError) as error:
            check.fail(f"half cache decode: {type(error).__name__}: {error}")
    forward_peaks = [r["reformer_peak_mib"] for r in report.get("forward", {}).get("rows", [])
                     if r["reformer_peak_mib"] is not None]
    served_peaks = [s["gpu_series"]["reformer_gpu_memory_peak_allocated_bytes"] / 2**20
                    for s in report.get("services", [])
                    if "reformer_gpu_memory_peak_allocated_bytes" in s.get("gpu_series", {})]
    report["peak_memory_mib"] = {"served": max(served_peaks, default=None), "forward": max(forward_peaks, default=None)}
    report["seconds"] = round(time.monotonic() - started, 1)
    report["failures"] = check.failures
    report["ok"] = not check.failures
    args.out.write_text(json.dumps(report, indent=2))
    print(f"gpu_check: {'all steps passed' if report['ok'] else 'FAILED'} in {report['seconds']} s; {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
