"""What a user installs against what the developers run: `/generate` tokens/s of the package installed by the
image's install step (docker/install.sh into a fresh venv, VARIANT=cpu, served with no compiler on PATH) and of
`make serve`'s development install (this checkout's .venv), in one run on one machine.

    python bench/serving/installed_vs_dev.py [--data corpus/data] [--clients 1,8] [--requests 16] [--new-tokens 128]
                                     [--rounds 2] [--out bench/results/installed_vs_dev.json]

Each server runs alone (the other is stopped), started as the image starts it; `/info`'s kernels and runs are
recorded for both. The two are measured in alternating rounds (dev, installed, dev, installed ...) at each
client count: closed loop, each client sending held-out prompts (512 bytes from the validation tails of the
books in --data) with greedy decoding of --new-tokens tokens (ignore_eos), tokens/s = generated tokens over
the wall time of the round. Prints a table with the load average beside it (run it through
bench/quiet_run.sh) and writes the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.server_process import ServerNotReady, ServerProcess  # noqa: E402
from train.corpus_manifest import set_folder  # noqa: E402


def install(into: Path) -> Path:
    """docker/install.sh (VARIANT=cpu) into a fresh venv from a copy of the build context; the venv's bin."""
    context = into / "src"
    for part in ("pyproject.toml", "setup.py", "README.md"):
        (context / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / part, context / part)
    for pkg in ("model", "train", "export", "service", "bench", "docker"):
        shutil.copytree(ROOT / pkg, context / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so",
                                                                                   "results", "wheels"))
    env = {**os.environ, "VARIANT": "cpu", "TORCH_VERSION": "2.13.0", "TORCH_INDEX_URL": "",
           "PIP_CONSTRAINT": str(ROOT / "constraints-cpu.txt"), "PYTHON": sys.executable}
    subprocess.run(["bash", "docker/install.sh", str(into / "venv"), str(context)], cwd=context, env=env,
                   check=True, capture_output=True, text=True, timeout=1200)
    return into / "venv" / "bin"


def prompts(data: Path, count: int, size: int = 512) -> list[str]:
    from train.data import find_text_files, read_document, split_point

    out: list[str] = []
    for f in find_text_files([data]):
        text = read_document(f)
        tail = text[split_point(len(text), 0.05):]
        out += [tail[i: i + size] for i in range(0, len(tail) - size, 4 * size)][: count]
    return out[:count] if len(out) >= count else (out * count)[:count]


def start_server(argv: list[str], path: str, home: Path, extra_env: dict[str, str] | None = None
                 ) -> tuple[ServerProcess, dict[str, Any]]:
    """A `reformer serve` process started with `argv` under a bare environment (HOME, PATH and logging set
    here), ready, with the /info fields that say which paths run."""
    env = {"HOME": str(home), "PATH": path, "LANG": "C.UTF-8", "REFORMER_LOG_LEVEL": "warning",
           "REFORMER_KERNEL_DIR": str(home / "kernels"), **(extra_env or {})}
    server = ServerProcess(argv, env=env, cwd=home)
    try:
        server.wait_ready(300)
        info = server.info()
    except (ServerNotReady, httpx.HTTPError) as error:
        server.stop()
        raise SystemExit(f"{argv} did not become ready: {error}") from None
    return server, {key: info.get(key) for key in ("kernels", "runs", "decode_backend", "batching")}


async def round_tokens_per_s(url: str, texts: list[str], clients: int, new_tokens: int) -> float:
    queue = list(texts)
    generated = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal generated
        while queue:
            text = queue.pop()
            r = await http.post(url + "/generate", json={"inputs": text, "parameters": {
                "max_new_tokens": new_tokens, "ignore_eos": True, "details": True}}, timeout=300)
            r.raise_for_status()
            generated += int(r.json()["details"]["generated_tokens"])

    async with httpx.AsyncClient() as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return generated / (time.perf_counter() - start)


def add_load_args(p: argparse.ArgumentParser, out: str) -> None:
    """The load options both A/B scripts take (this one and bench/serving/serve_ab.py)."""
    p.add_argument("--data", type=Path, default=set_folder("data"),
                   help="folder of books (default: corpus/data, written by `reformer data`)")
    p.add_argument("--clients", default="1,8")
    p.add_argument("--requests", type=int, default=16, help="requests per round")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / out)


Side = tuple[list[str], str, dict[str, str]]  # a server's command line, PATH and extra environment


def measure(sides: dict[str, Side], home: Path, args: argparse.Namespace
            ) -> tuple[dict[str, dict[int, list[float]]], dict[str, Any]]:
    """tokens/s of every side at every --clients level, --rounds times, each server alone and the sides in
    turns; and each side's /info (kernels, runs)."""
    texts = prompts(args.data, args.requests)
    levels = [int(c) for c in args.clients.split(",")]
    results: dict[str, dict[int, list[float]]] = {s: {c: [] for c in levels} for s in sides}
    infos: dict[str, Any] = {}
    for _ in range(args.rounds):
        for side, (argv, path, extra) in sides.items():
            server, infos[side] = start_server(argv, path, home, extra)
            try:
                asyncio.run(round_tokens_per_s(server.url, texts[:2], 1, 8))  # warm-up
                for c in levels:
                    results[side][c].append(asyncio.run(round_tokens_per_s(server.url, texts, c, args.new_tokens)))
            finally:
                server.stop()
    return results, infos


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(p, "installed_vs_dev.json")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        installed_bin = install(work)
        install_s = time.monotonic() - t0
        home = work / "home"
        home.mkdir()
        sides: dict[str, Side] = {
            "dev": ([str(ROOT / ".venv" / "bin" / "reformer"), "serve"], os.environ["PATH"], {}),
            # no compiler on the installed side's PATH
            "installed": ([str(installed_bin / "reformer"), "serve"], str(installed_bin), {})}
        results, infos = measure(sides, home, args)
    load = os.getloadavg()
    rows = []
    for c in levels:
        dev, inst = max(results["dev"][c]), max(results["installed"][c])
        rows.append({"clients": c, "dev_tokens_per_s": results["dev"][c], "installed_tokens_per_s":
                     results["installed"][c], "best_ratio_installed_over_dev": inst / dev})
    report = {"command": " ".join(["python", "bench/serving/installed_vs_dev.py", *(argv or sys.argv[1:])]),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d"), "load_after": load, "install_seconds": install_s,
              "requests_per_round": args.requests, "new_tokens": args.new_tokens, "servers": infos, "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"dev kernels: {infos['dev']}\ninstalled kernels: {infos['installed']}")
    print("| clients | make serve tokens/s | installed tokens/s | installed / dev (best of rounds) |")
    print("|---:|---|---|---:|")
    for r in rows:
        print(f"| {r['clients']} | {', '.join(f'{x:.0f}' for x in r['dev_tokens_per_s'])} | "
              f"{', '.join(f'{x:.0f}' for x in r['installed_tokens_per_s'])} | "
              f"{r['best_ratio_installed_over_dev']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
