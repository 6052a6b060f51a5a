"""`reformer import-hf` of a checkpoint with google/reformer-enwik8's exact configuration (random weights),
timed: wall time and peak RSS of each variant, and the refusal of two damaged copies.

    python bench/import_hf/import_hf_enwik8.py [--work /tmp/import_hf_enwik8] [--limit 180]
                                     [--variants no-onnx,skip-parity,skip-parity+no-onnx]
                                     [--out bench/results/import_hf_enwik8.json]

The checkpoint is built as the issue built it (transformers.ReformerConfig with enwik8's values,
torch.manual_seed(8), ReformerModelWithLMHead(cfg).save_pretrained) unless --work already holds it. Each
variant runs `python -m service.cli import-hf CKPT OUT FLAGS` from this tree through
`nice -n 10 /usr/bin/time -v timeout LIMIT` (a run past --limit seconds is stopped and recorded as such,
with the last progress line it logged); the damaged copies are the checkpoint with its safetensors file
truncated by 1 MB, and with 64 bytes in the middle of the weights set to 0xff (NaN float32s: the file still
parses). Writes the JSON with the load average around each run (the machine's two cores are shared).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FLAGS = {"default": [], "no-onnx": ["--no-onnx"], "skip-parity": ["--skip-parity"],
         "skip-parity+no-onnx": ["--skip-parity", "--no-onnx"]}
ENWIK8: dict[str, Any] = dict(
    vocab_size=258, hidden_size=1024, num_attention_heads=8, attention_head_size=128,
    attn_layers=["local", "local", "lsh", "local", "local", "local", "lsh", "local", "local", "local", "lsh", "local"],
    feed_forward_size=4096, hidden_act="relu", num_hashes=4, num_buckets=512, lsh_attn_chunk_length=256,
    local_attn_chunk_length=128, lsh_num_chunks_before=1, lsh_num_chunks_after=0, local_num_chunks_before=1,
    local_num_chunks_after=0, axial_pos_shape=[128, 512], axial_pos_embds_dim=[256, 768],
    max_position_embeddings=65536, hash_seed=None, hidden_dropout_prob=0.2, lsh_attention_probs_dropout_prob=0.1,
    local_attention_probs_dropout_prob=0.2, is_decoder=True, eos_token_id=2)


def build_checkpoint(directory: Path) -> Path:
    if (directory / "model.safetensors").is_file():
        return directory
    import torch
    import transformers

    torch.manual_seed(8)
    transformers.ReformerModelWithLMHead(transformers.ReformerConfig(**ENWIK8)).save_pretrained(str(directory))
    return directory


def damaged_copies(ckpt: Path, work: Path) -> dict[str, Path]:
    out = {}
    size = (ckpt / "model.safetensors").stat().st_size
    for name in ("truncated", "nan-bytes"):
        d = work / f"ckpt-{name}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        shutil.copy(ckpt / "config.json", d / "config.json")
        shutil.copy(ckpt / "model.safetensors", d / "model.safetensors")
        with open(d / "model.safetensors", "r+b") as f:
            if name == "truncated":
                f.truncate(size - (1 << 20))
            else:
                f.seek(size // 2 // 4 * 4)  # float32-aligned, well inside the tensor data
                f.write(b"\xff" * 64)
        out[name] = d
    return out


def timed(args: list[str], limit: int) -> dict[str, Any]:
    """Run `args` through nice, /usr/bin/time -v and timeout; wall, peak RSS, exit status, output tail."""
    cmd = ["nice", "-n", "10", "/usr/bin/time", "-v", "timeout", str(limit), sys.executable, "-m", "service.cli",
           *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    err = proc.stderr
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    elapsed = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", err)
    cpu = [re.search(rf"{k} time \(seconds\): ([\d.]+)", err) for k in ("User", "System")]
    # /usr/bin/time's report is parsed above; torch.onnx's warnings about torchvision say nothing here
    log = [line for line in err.splitlines()
           if line and not line.startswith("\t") and "Command exited" not in line and "torchvision" not in line]
    return {"command": " ".join(cmd[:6] + ["python", "-m", "service.cli", *args]),
            "exit_status": proc.returncode, "timed_out": proc.returncode == 124, "wall_s": round(wall, 1),
            "time_elapsed": elapsed.group(1) if elapsed else None,
            "cpu_s": round(sum(float(m.group(1)) for m in cpu if m), 1),
            "peak_rss_mb": round(int(rss.group(1)) / 1024) if rss else None,
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
            "stdout_tail": proc.stdout.strip().splitlines()[-6:], "log_tail": log[-8:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/import_hf_enwik8"))
    p.add_argument("--limit", type=int, default=180, help="seconds after which a run is stopped")
    p.add_argument("--variants", default="no-onnx,skip-parity,skip-parity+no-onnx",
                   help=f"comma-separated, of {', '.join(FLAGS)}")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "import_hf_enwik8.json")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    ckpt = build_checkpoint(args.work / "ckpt")
    result: dict[str, Any] = {
        "checkpoint": {"config": ENWIK8, "seed": 8, "built_with": "ReformerModelWithLMHead(cfg).save_pretrained",
                       "weights_bytes": (ckpt / "model.safetensors").stat().st_size,
                       "build_s": round(time.monotonic() - start, 1)},
        "machine": {"cpus": os.cpu_count(), "note": "two cores shared with other sessions; load averages per run"},
        "bench_command": " ".join(["python", *sys.argv]),
        "commit": subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                                 text=True).stdout.strip(),
        "runs": {}, "damaged": {}}
    for variant in args.variants.split(","):
        out = args.work / f"art-{variant}"
        shutil.rmtree(out, ignore_errors=True)
        run = timed(["import-hf", str(ckpt), str(out), *FLAGS[variant]], args.limit)
        manifest = out / "manifest.json"
        if run["exit_status"] == 0 and manifest.is_file():
            m = json.loads(manifest.read_text())
            run["parity"] = m["evaluation"]["transformers_parity"]
            onnx = m.get("export", {}).get("onnx")
            if onnx:
                keys = ("export_seconds", "phase_seconds", "nodes", "optimized", "verification", "max_abs_diff")
                run["onnx"] = {k: onnx.get(k) for k in keys}
        result["runs"][variant] = run
        print(variant, {k: run[k] for k in ("exit_status", "wall_s", "peak_rss_mb")}, flush=True)
    for name, d in damaged_copies(ckpt, args.work).items():
        run = timed(["import-hf", str(d), str(args.work / f"art-{name}"), "--no-onnx"], args.limit)
        run["refused"] = run["exit_status"] == 1 and not (args.work / f"art-{name}").exists()
        result["damaged"][name] = run
        print(name, {k: run[k] for k in ("exit_status", "wall_s", "refused")}, run["log_tail"][-1:], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
