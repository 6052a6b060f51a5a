"""`reformer train` under torchrun with two CPU processes (gloo): the gradient sync works through the
reversible layers' custom backward, both ranks end with identical weights, and those weights equal one
process stepping on the combined batch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from model import ReformerConfig, ReformerLM
from train.checkpoint import read_checkpoint_metadata
from train.loop import main as train_main

ROOT = Path(__file__).resolve().parents[2]
# dropout off: a rank draws its own dropout masks, which one process cannot reproduce
COMMON = ["--hidden-size", "32", "--num-heads", "2", "--attn-layers", "local,lsh", "--feed-forward-size", "64",
          "--chunk-length", "16", "--num-buckets", "4", "--axial-pos-shape", "16,64", "--max-positions", "1024",
          "--window", "64", "--grad-accum", "2", "--warmup-steps", "1", "--lr", "3e-3", "--dropout", "0",
          "--max-steps", "3", "--eval-every", "0", "--final-val-windows", "2", "--threads", "1",
          "--no-progress"]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ddp_corpus")
    rng = np.random.default_rng(1)
    for i in range(2):
        (d / f"doc{i}.txt").write_text("".join(rng.choice(list("abcdefgh ij\n"), size=3000)), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def single_process(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("single")
    assert train_main([str(corpus), "--out", str(out), "--batch-size", "2", *COMMON]) == 0
    return _weights(out / "checkpoint")


@pytest.mark.parametrize("ddp_mode", ["wrap", "allreduce"])
def test_two_ranks_equal_one_process_on_the_combined_batch(
        corpus: Path, tmp_path: Path, single_process: dict[str, torch.Tensor], ddp_mode: str) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "ddp"
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "service.cli", "train", str(corpus),
         "--out", str(out), "--batch-size", "1", "--ddp", ddp_mode, *COMMON],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prov = read_checkpoint_metadata(out / "checkpoint")["provenance"]
    assert prov["world_size"] == 2 and prov["ddp"] == ddp_mode
    assert prov["tokens_seen"] == 3 * 2 * 2 * 64  # steps x accumulation x ranks x window
    # both replicas identical (the trainer compares every rank's weights with rank 0's at the end)
    assert prov["max_weight_divergence_across_ranks"] == 0.0
    ranks = _weights(out / "checkpoint")
    assert ranks.keys() == single_process.keys()
    worst = max(float((ranks[k] - single_process[k]).abs().max()) for k in ranks)
    assert worst <= 1e-5
    # and training moved the weights: the comparison is not between two untouched initialisations
    torch.manual_seed(0)
    initial = ReformerLM(ReformerConfig.from_dict(read_checkpoint_metadata(out / "checkpoint")["config"]))
    moved = max(float((ranks[k] - v).abs().max()) for k, v in initial.state_dict().items())
    assert moved > 1e-3
