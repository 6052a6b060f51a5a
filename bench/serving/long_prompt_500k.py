"""A half-million-token prompt served (issue 46, item 5): `reformer serve` on an artifact of
google/reformer-crime-and-punishment's configuration (524,288 positions; bench/import_hf/import_hf_crime.py writes one
with random weights), prompts of 1K / 64K / 500K tokens through `/v1/completions` (streaming) and
`/generate`, against the in-process forward of the same lengths.

    python bench/serving/long_prompt_500k.py ARTIFACT --book BOOK.txt [--lengths 1000,64000,500000]
        [--generate-lengths 500000] [--new-tokens 128] [--forward-lengths 64000,500000]
        [--cache-bytes 4294967296] [--small-cache-bytes 1073741824] [--out bench/results/long_prompt_500k.json]

Prompts are the book's text (repeated when short) cut to the length in the artifact's tokenizer. One server
(python -m service.cli serve, max_batch_size 2, --cache-bytes) answers, one request at a time:
1. for each length of --lengths, a streamed completion of --new-tokens tokens (ignore_eos, greedy): TTFT
   (request sent to first streamed token), prefill tokens/s (prompt tokens / TTFT), inter-token latency (the
   mean gap between streamed tokens after the first: events may arrive several per read). For the longest
   length a second stream (a 1K prompt) is decoding when the long prompt arrives: its longest gap while the
   long prompt is prefilled says whether the prefill ran in slices between its steps
   (REFORMER_PREFILL_BUDGET_MS); it is closed at the long prompt's first token, and the long prompt's
   inter-token latency counts only its tokens after the second stream's last one;
2. for each length of --generate-lengths, one `/generate` of --new-tokens tokens (its wall time); for the
   longest, a 1K-token streamed request arrives 2 s later, when nothing else runs: its TTFT;
3. refusals: a prompt past the model's 524,288 positions, and (a second server with --small-cache-bytes) the
   longest prompt, which that cache cannot hold: status and message.
The server's peak RSS is its VmHWM (/proc) after each phase. Then this process runs the model's forward
(torch, inference mode, one row) on --forward-lengths tokens: tokens/s. Writes the JSON and prints a table.
Run it alone (bench/quiet_run.sh): the two cores are the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the tree's packages are importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx  # noqa: E402

from bench.server_process import ServerProcess, service_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--book", type=Path, required=True, help="plain text the prompts are cut from")
    p.add_argument("--lengths", default="1000,64000,500000")
    p.add_argument("--generate-lengths", default="500000")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--forward-lengths", default="64000,500000")
    p.add_argument("--cache-bytes", type=int, default=4 * 2**30)
    p.add_argument("--small-cache-bytes", type=int, default=2**30)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one request may take")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/long_prompt_500k.json")
    p.add_argument("--logs", type=Path, default=Path("/tmp/long_prompt_500k_logs"), help="the servers' logs")
    return p


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def prompt_texts(tokenizer: Any, book: Path, lengths: list[int]) -> dict[int, tuple[str, int]]:
    """Each length -> (the book's text cut to about that many tokens, its token count as the server counts)."""
    text = book.read_text(encoding="utf-8", errors="replace")
    ids = tokenizer.encode(text)
    most = max(lengths)
    repeats = -(-most // len(ids)) + 1
    ids = tokenizer.encode("\n".join([text] * repeats)) if repeats > 1 else ids
    out = {}
    for n in lengths:
        cut = tokenizer.decode(ids[:n])
        out[n] = (cut, len(tokenizer.encode(cut)))
    return out


def start_server(artifact: Path, cache_bytes: int, log: Path) -> ServerProcess:
    """The service on `artifact` with a cache of `cache_bytes`, two rows and no token or time limits in the way
    of a 500K-token request; ready when returned."""
    env = dict(os.environ, REFORMER_CACHE_BYTES=str(cache_bytes), REFORMER_MAX_BATCH_SIZE="2",
               REFORMER_MAX_NEW_TOKENS="100000", REFORMER_REQUEST_TIMEOUT_S="3600")
    return ServerProcess.ready(service_argv(artifact), log_path=log, env=env)


def stream(url: str, prompt: str, new_tokens: int, timeout: float, stop: threading.Event | None = None,
           first_token: threading.Event | None = None) -> dict[str, Any]:
    """A streamed /v1/completions: the arrival time of each event carrying text (monotonic), and usage. It
    stops reading (closing the connection) at the first event after `stop` is set, and sets `first_token`
    when its first event arrives."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "stream": True, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    arrivals: list[float] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return {"sent": sent, "status": r.status_code, "error": r.text[:500], "arrivals": []}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices"):
                arrivals.append(time.monotonic())
                if first_token is not None:
                    first_token.set()
            if stop is not None and stop.is_set():
                break
    return {"sent": sent, "status": 200, "arrivals": arrivals, "usage": usage}


def gaps_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in zip(times, times[1:], strict=False)]


def streamed_case(url: str, prompt: str, tokens: int, new_tokens: int, timeout: float, background: str | None
                  ) -> dict[str, Any]:
    """One streamed completion, with a background stream decoding while it is prefilled when `background`
    (closed at the long prompt's first token)."""
    held: dict[str, Any] = {}
    first_token = threading.Event()
    thread = None
    if background is not None:
        thread = threading.Thread(target=lambda: held.update(stream(url, background, 100000, timeout, first_token)))
        thread.start()
        time.sleep(3.0)  # the background stream is decoding before the long prompt arrives
    res = stream(url, prompt, new_tokens, timeout, first_token=first_token)
    first_token.set()
    if thread is not None:
        thread.join(timeout)
    case: dict[str, Any] = {"prompt_tokens": tokens, "status": res["status"]}
    if res["status"] != 200 or not res["arrivals"]:
        case["error"] = res.get("error")
        return case
    first = res["arrivals"][0]
    # inter-token latency over the tokens decoded alone: after the background stream's last token
    alone_from = max(held.get("arrivals") or [first])
    after = [t for t in res["arrivals"] if t > alone_from]
    itl = gaps_ms(after)
    ttft = first - res["sent"]
    case.update(server_prompt_tokens=res["usage"].get("prompt_tokens"), tokens_streamed=len(res["arrivals"]),
                ttft_s=round(ttft, 3), prefill_tokens_per_s=round(tokens / ttft, 1),
                # the mean gap: events can arrive in bursts (several per read), which a median would hide
                inter_token_ms_mean=round((after[-1] - after[0]) * 1000 / (len(after) - 1), 3) if len(after) > 1
                else None,
                inter_token_ms_p90=round(sorted(itl)[int(0.9 * (len(itl) - 1))], 3) if itl else None,
                inter_token_gaps_counted=len(itl))
    if background is not None:
        arrivals = held.get("arrivals", [])
        during = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b > res["sent"] and a < first]
        before = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b <= res["sent"]]
        case["background_stream"] = {
            "status": held.get("status"), "tokens_during_prefill": len(during),
            "longest_gap_during_prefill_ms": round(max(during) * 1000, 1) if during else None,
            "mean_gap_during_prefill_ms": round(sum(during) * 1000 / len(during), 1) if during else None,
            "mean_gap_before_ms": round(sum(before) * 1000 / len(before), 2) if before else None}
    return case


def generate_case(url: str, prompt: str, tokens: int, new_tokens: int, timeout: float, late: str | None
                  ) -> dict[str, Any]:
    """One /generate; with `late`, a short streamed request arrives 2 s after it (nothing else running, so the
    long prompt's prefill is not sliced): that request's TTFT."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True,
                                             "details": True}}
    held: dict[str, Any] = {}
    thread = None
    if late is not None:
        def late_request() -> None:
            time.sleep(2.0)
            held.update(stream(url, late, 16, timeout))
        thread = threading.Thread(target=late_request)
        thread.start()
    sent = time.monotonic()
    r = httpx.post(url + "/generate", json=body, timeout=timeout)
    done = time.monotonic()
    out: dict[str, Any] = {"prompt_tokens": tokens, "status": r.status_code, "wall_s": round(done - sent, 2)}
    if r.status_code == 200:
        out["generated_tokens"] = r.json().get("details", {}).get("generated_tokens")
    else:
        out["error"] = r.text[:500]
    if thread is not None:
        thread.join(timeout)
        arrivals = held.get("arrivals") or []
        out["late_short_stream"] = {
            "status": held.get("status"),
            "ttft_s": round(arrivals[0] - held["sent"], 3) if arrivals else None,
            "first_token_before_generate_answered": bool(arrivals) and arrivals[0] < done}
    return out


def refusal(url: str, prompt: str, tokens: int, new_tokens: int) -> dict[str, Any]:
    """The same prompt through /v1/completions and /generate: each answer's status and body."""
    out: dict[str, Any] = {"prompt_tokens": tokens, "max_tokens": new_tokens}
    for route, body in (("/v1/completions", {"prompt": prompt, "max_tokens": new_tokens}),
                        ("/generate", {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens}})):
        r = httpx.post(url + route, json=body, timeout=600)
        out[route] = {"status": r.status_code, "body": r.text[:600]}
    return out


def cache_bytes_per_token(lm: Any) -> dict[str, Any]:
    """The decode cache's bytes per cached position, per layer kind, as model/decoding/cache.py counts them: an
    LSH layer keeps every position in blocks, a local layer only its window, in a ring per slot
    (model/decoding/local_ring.py), counted per slot."""
    import torch

    from model.decoding import DecodeCache
    from model.decoding.lsh_index import LSHIndex

    cfg = lm.config
    cache = DecodeCache(lm, 0, 1, cpu_kernel=False)
    kv_elt = torch.finfo(cache.kv_dtype).bits // 8
    kv = 2 * cache.heads * cache.head_size * kv_elt  # a key and a value per head
    lsh = kv + cache.heads * (torch.finfo(cache.dtype).bits // 8) + LSHIndex.token_bytes(
        cache.heads, cfg.num_hashes, cfg.max_position_embeddings)
    kinds = list(cfg.attn_layers)
    return {"bytes_per_token": cache.bytes_per_token, "local_layer_position": kv, "lsh_layer": lsh,
            "local_layers": kinds.count("local"), "lsh_layers": kinds.count("lsh"),
            "local_window_positions": cache.ring.width, "local_bytes_per_slot": cache.ring_bytes_per_slot,
            "reserved_bytes_per_slot": cache.reserved_bytes_per_slot}


def forward_speed(lm: Any, lengths: list[int]) -> dict[int, dict[str, float]]:
    import torch

    out = {}
    for n in lengths:
        ids = torch.randint(3, lm.config.vocab_size, (1, n))
        with torch.inference_mode():
            start = time.monotonic()
            lm(ids)
            wall = time.monotonic() - start
        out[n] = {"wall_s": round(wall, 2), "tokens_per_s": round(n / wall, 1)}
    return out


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout
    return head.strip() + ("-dirty" if dirty.strip() else "")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from export import load_artifact

    torch.set_num_threads(2)
    art = load_artifact(args.artifact)
    lengths, gen_lengths, fwd_lengths = ints(args.lengths), ints(args.generate_lengths), ints(args.forward_lengths)
    limit = art.model.config.max_position_embeddings
    texts = prompt_texts(art.tokenizer, args.book, sorted({*lengths, *gen_lengths, 1000, limit + 1000}))
    command = ["python", "bench/serving/long_prompt_500k.py", *(argv or sys.argv[1:])]
    result: dict[str, Any] = {"command": " ".join(command),
                              "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "load_before": load(), "artifact": str(args.artifact),
                              "max_position_embeddings": limit, "new_tokens": args.new_tokens}
    log_dir = args.logs
    log_dir.mkdir(parents=True, exist_ok=True)
    server = start_server(args.artifact, args.cache_bytes, log_dir / "server.log")
    try:
        info = server.info()
        result["server_info"] = info
        result["peak_rss_mb"] = {"ready": server.peak_rss_mb()}
        streamed = {}
        for n in lengths:
            background = texts[1000][0] if n == max(lengths) and n > 1000 else None
            streamed[n] = streamed_case(server.url, texts[n][0], texts[n][1], args.new_tokens, args.timeout,
                                        background)
            result["peak_rss_mb"][f"after_stream_{n}"] = server.peak_rss_mb()
            print(json.dumps({str(n): streamed[n]}), flush=True)
        result["streamed"] = streamed
        generated = {}
        for n in gen_lengths:
            late = texts[1000][0] if n == max(gen_lengths) and n > 1000 else None
            generated[n] = generate_case(server.url, texts[n][0], texts[n][1], args.new_tokens, args.timeout, late)
            result["peak_rss_mb"][f"after_generate_{n}"] = server.peak_rss_mb()
            print(json.dumps({str(n): generated[n]}), flush=True)
        result["generate"] = generated
        big = texts[limit + 1000]
        result["refused"] = {"past_positions": refusal(server.url, big[0], big[1], args.new_tokens)}
    finally:
        server.stop()
    small = start_server(args.artifact, args.small_cache_bytes, log_dir / "server_small_cache.log")
    try:
        n = max(lengths)
        result["refused"]["past_cache_budget"] = {
            "cache_bytes": args.small_cache_bytes, **refusal(small.url, texts[n][0], texts[n][1], args.new_tokens)}
    finally:
        small.stop()
    result["decode_cache"] = cache_bytes_per_token(art.model)
    result["forward_in_process"] = forward_speed(art.model, fwd_lengths)
    result["load_after"] = load()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'prompt tokens':>13} {'TTFT s':>8} {'prefill tok/s':>13} {'ITL ms':>8} {'forward tok/s':>13}")
    fwd = result.get("forward_in_process", {})
    for n, case in result["streamed"].items():
        f = fwd.get(n, {}).get("tokens_per_s", "")
        cells = [case.get("ttft_s", case["status"]), case.get("prefill_tokens_per_s"), case.get("inter_token_ms_mean")]
        ttft, rate, itl = (str(c) for c in cells)
        print(f"{case['prompt_tokens']:>13} {ttft:>8} {rate:>13} {itl:>8} {f!s:>13}")
    print("peak RSS MB:", result["peak_rss_mb"])
    print("decode cache bytes per token:", result["decode_cache"])
    for name, r in result.get("refused", {}).items():
        for route in ("/v1/completions", "/generate"):
            print(f"refused {name} {route}: {r[route]['status']} {r[route]['body'][:220]}")
    print("load before/after:", result["load_before"], "/", result["load_after"])


if __name__ == "__main__":
    raise SystemExit(main())
