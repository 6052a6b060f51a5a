"""EleutherAI's lm-evaluation-harness as a client of the service: `lm_eval --model local-completions` with the
server's own tokenizer (`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize; token-id prompts;
echo with logprobs) on three local tasks this script writes from held-out text, then the rolling task's bits per
byte again in process, on the same windows lm-eval scores, to compare.

    python bench/quality/lm_eval_client.py [--artifact DIR] [--base-url http://127.0.0.1:8000] [--data FILE_OR_DIR ...]
                                   [--lm-eval PATH] [--max-length 256] [--docs 6] [--doc-bytes 3000]
                                   [--out bench/results/lm_eval_client.json]

Tasks (in a temporary folder, as lm-eval's `--include_path`):
  reformer_rolling   loglikelihood_rolling of each document: word/byte perplexity, bits_per_byte
  reformer_cloze     multiple choice: a passage's true 64-byte ending against three endings of other passages
  reformer_generate  generate_until: a passage's next bytes, greedy, until a newline; exact_match
Documents are consecutive `--doc-bytes` pieces of the held-out tails of `--data` (the last 5% of each file, as
the trainer holds it out), or of export/quantize.py's built-in text when no data is given.

lm-eval is not a dependency of the project (it is heavy); install it apart, e.g.
    python -m venv .venv-lmeval && .venv-lmeval/bin/pip install -c constraints-cpu.txt "lm-eval[api]==0.4.13"
`--lm-eval` names its executable (default: .venv-lmeval/bin/lm_eval, else lm_eval on PATH). Without
`--base-url` the script starts `python -m service ARTIFACT` on a free loopback port and stops it after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.server_process import ServerProcess, service_argv  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CLOZE_BYTES = 64
GENERATE_BYTES = 24


def held_out_text(data: list[Path]) -> str:
    """The held-out tails of the files (as the trainer cuts them), or the built-in evaluation text."""
    if not data:
        from export.quantize import BUILTIN_EVAL_TEXT

        return BUILTIN_EVAL_TEXT.decode()
    from model import ByteTokenizer
    from train.evaluation import validation_tails

    tails = validation_tails(data, 0.05, ByteTokenizer())
    return "\n\n".join(ByteTokenizer().decode([int(i) for i in ids]) for _, ids in tails)


def documents(text: str, count: int, size: int) -> list[str]:
    """`count` consecutive, distinct pieces of `size` bytes (smaller when the text is too short for them)."""
    raw = text.encode()
    size = min(size, len(raw) // count)
    if size < CLOZE_BYTES * 2:
        raise SystemExit(f"{len(raw)} bytes of text are too few for {count} documents: give --data or fewer --docs")
    return [raw[i * size:(i + 1) * size].decode(errors="ignore") for i in range(count)]


def write_tasks(folder: Path, docs: list[str]) -> None:
    """Three task YAMLs and their JSON-lines data in `folder`."""
    rows = {
        "rolling": [{"text": d} for d in docs],
        "cloze": [],
        "generate": [],
    }
    endings = [d.encode()[-CLOZE_BYTES:].decode(errors="ignore") for d in docs]
    for i, doc in enumerate(docs):
        raw = doc.encode()
        context = raw[:-CLOZE_BYTES].decode(errors="ignore")
        others = [endings[(i + k) % len(docs)] for k in (1, 2, 3)]
        gold = i % 4
        choices = others[:gold] + [endings[i]] + others[gold:]
        rows["cloze"].append({"context": context, "choices": choices, "gold": gold})
        cut = raw[:-GENERATE_BYTES].decode(errors="ignore")
        rows["generate"].append({"context": cut, "target": doc[len(cut):].split("\n")[0]})
    for name, items in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    common = "dataset_path: json\ntest_split: test\n"
    specs = {
        "rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                   "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
                   "  - metric: bits_per_byte\n",
        "cloze": "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
                 "doc_to_target: '{{gold}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n",
        "generate": "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{target}}'\n"
                    "target_delimiter: ''\ngeneration_kwargs:\n  until: ['\\n']\n"
                    f"  max_gen_toks: {GENERATE_BYTES}\n  do_sample: false\n  temperature: 0\n"
                    "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n",
    }
    for name, spec in specs.items():
        data = f"dataset_kwargs:\n  data_files:\n    test: {folder / (name + '.jsonl')}\n"
        (folder / f"reformer_{name}.yaml").write_text(f"task: reformer_{name}\n{common}{data}{spec}")


def start_server(artifact: Path, log: Path) -> ServerProcess:
    return ServerProcess.ready(service_argv(artifact), log_path=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def lm_eval_executable(given: str | None) -> str:
    if given:
        return given
    local = ROOT / ".venv-lmeval" / "bin" / "lm_eval"
    found = str(local) if local.exists() else shutil.which("lm_eval")
    if found is None:
        raise SystemExit("lm_eval not found: install it apart (see this script's docstring) or pass --lm-eval")
    return found


def run_lm_eval(exe: str, url: str, model: str, tasks: Path, out: Path, max_length: int) -> dict[str, Any]:
    args = [exe, "run", "--model", "local-completions", "--model_args", f"base_url={url}/v1/completions",
            f"model={model}", "tokenizer_backend=remote", f"max_length={max_length}", "num_concurrent=1",
            "max_retries=1", "tokenized_requests=True",
            "--tasks", "reformer_rolling", "reformer_cloze", "reformer_generate", "--include_path", str(tasks),
            "--batch_size", "1", "--output_path", str(out)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    began = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"lm_eval failed ({done.returncode}):\n{done.stderr[-6000:]}")
    found = sorted(out.rglob("results_*.json"))
    if not found:
        raise SystemExit(f"lm_eval wrote no results under {out}:\n{done.stderr[-3000:]}")
    results = json.loads(found[-1].read_text())
    return {"command": " ".join(args), "seconds": round(time.perf_counter() - began, 1),
            "results": results["results"]}


def rolling_windows(ids: list[int], prefix: int, max_seq_len: int) -> Iterator[tuple[list[int], list[int]]]:
    """(context, continuation) pairs as lm-eval's get_rolling_token_windows and make_disjoint_window cut a
    document (context_len 1): every token predicted once, each window conditioned on what precedes it in it."""
    first = min(max_seq_len, len(ids))
    windows = [([prefix, *ids[:first - 1]], ids[:first])]
    predicted = first
    while predicted < len(ids):
        take = min(len(ids) - predicted, max_seq_len)
        end = predicted + take
        windows.append((ids[max(end - max_seq_len - 1, 0):end - 1], ids[end - take:end]))
        predicted += take
    for whole, pred in windows:
        yield whole[:len(whole) - len(pred) + 1], pred


def in_process_bits_per_byte(artifact: Path, docs: list[str], max_length: int) -> dict[str, Any]:
    """The rolling task's figure without the service: the artifact's model on the same windows (lm-eval's
    max_length less 2 tokens each: one it keeps for generation, one for context)."""
    import torch

    from export import load_artifact

    art = load_artifact(artifact)
    tok = art.tokenizer
    total_ll, total_bytes = 0.0, 0
    began = time.perf_counter()
    with torch.no_grad():
        for doc in docs:
            for context, continuation in rolling_windows(tok.encode(doc), tok.eos_id, max_length - 2):
                ids = torch.tensor([context + continuation])  # (1, T)
                logits = art.model(ids[:, :-1]).logits.float()  # (1, T-1, vocab)
                logp = torch.log_softmax(logits, dim=-1)[0]  # (T-1, vocab)
                targets = ids[0, len(context):]  # (len(continuation),)
                rows = torch.arange(len(context) - 1, ids.shape[1] - 1)
                total_ll += float(logp[rows, targets].sum())
            total_bytes += len(doc.encode())
    return {"bits_per_byte": -total_ll / total_bytes / math.log(2), "bytes": total_bytes,
            "seconds": round(time.perf_counter() - began, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path, default=ROOT / "export" / "default_artifact")
    p.add_argument("--base-url", help="a running server (default: start one on the artifact)")
    p.add_argument("--data", type=Path, nargs="*", default=[], help="text files or folders (held-out tails)")
    p.add_argument("--lm-eval", help="the lm_eval executable")
    p.add_argument("--max-length", type=int, default=256,
                   help="lm-eval's max_length (tokens per request; a longer document is scored in several windows)")
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--doc-bytes", type=int, default=3000)
    p.add_argument("--out", type=Path, default=RESULTS / "lm_eval_client.json")
    args = p.parse_args()
    exe = lm_eval_executable(args.lm_eval)
    docs = documents(held_out_text(args.data), args.docs, args.doc_bytes)
    with tempfile.TemporaryDirectory(prefix="lm_eval_tasks.") as tmp:
        folder = Path(tmp)
        write_tasks(folder, docs)
        server = None
        url = args.base_url
        if url is None:
            server = start_server(args.artifact, folder / "server.log")
            url = server.url
        try:
            import httpx

            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            run = run_lm_eval(exe, url, model, folder, folder / "out", args.max_length)
        finally:
            if server is not None:
                server.stop(30)
    local = in_process_bits_per_byte(args.artifact, docs, args.max_length)
    served = run["results"]["reformer_rolling"]["bits_per_byte,none"]
    report = {
        "command": " ".join(["python", "bench/quality/lm_eval_client.py", *sys.argv[1:]]),
        "artifact": str(args.artifact), "docs": len(docs), "doc_bytes": [len(d.encode()) for d in docs],
        "max_length": args.max_length, "data": [str(d) for d in args.data] or "built-in text",
        "lm_eval": run, "in_process": local,
        "rolling_bits_per_byte": {"lm_eval_through_service": served, "in_process": local["bits_per_byte"],
                                  "relative_difference": abs(served - local["bits_per_byte"]) / local["bits_per_byte"]},
        "cloze_acc": run["results"]["reformer_cloze"]["acc,none"],
        "generate_exact_match": run["results"]["reformer_generate"]["exact_match,none"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("rolling_bits_per_byte", "cloze_acc", "generate_exact_match")},
                     indent=2))


if __name__ == "__main__":
    main()
