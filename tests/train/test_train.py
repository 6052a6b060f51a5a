"""`reformer train` end to end on a tiny corpus written here: steps, validation, checkpoint format,
resume, reproducibility, the time budget and Ctrl-C."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from export.checkpoint import read_checkpoint_weights
from train.checkpoint import load_model, read_checkpoint_metadata
from train.loop import main as train_main
from train.runtime import lr_factor, parse_duration

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "32", "--num-heads", "2", "--attn-layers", "local,lsh", "--feed-forward-size", "64",
        "--chunk-length", "16", "--num-buckets", "4", "--axial-pos-shape", "16,64", "--max-positions", "1024",
        "--window", "96", "--batch-size", "2", "--warmup-steps", "2", "--lr", "3e-3", "--threads", "1",
        "--val-windows", "4", "--no-progress"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = "the a king queen said and to of in that it was his her my lord".split()
    for i in range(2):
        body = " ".join(rng.choice(words, size=900 + 300 * i)) + "\n"
        (d / f"book{i}.txt").write_text(
            f"\ufeffHeader\r\n*** START OF THIS PROJECT GUTENBERG EBOOK B{i} ***\r\n{body}"
            f"*** END OF THIS PROJECT GUTENBERG EBOOK B{i} ***\r\nlicence\r\n", encoding="utf-8")
    return d


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_train_end_to_end_checkpoint_format(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rc = train_main([str(corpus), "--out", str(out), "--max-steps", "6", "--eval-every", "3",
                     "--save-every", "3", "--dropout", "0.1", *TINY])
    assert rc == 0
    ckpt = out / "checkpoint"
    assert {p.name for p in ckpt.iterdir()} == {"model.safetensors", "optimizer.pt", "trainer_state.json"}
    meta = read_checkpoint_metadata(ckpt)
    assert meta["config"]["hidden_size"] == 32 and meta["config"]["num_buckets"] == 4
    prov = meta["provenance"]
    assert prov["steps"] == 6 and prov["tokens_seen"] == 6 * 2 * 96 and prov["seed"] == 0
    assert prov["command"].startswith("reformer train ") and "--max-steps 6" in prov["command"]
    assert prov["code_version"]
    files = {f["name"]: f["sha256"] for f in prov["data_files"]}
    assert files == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in corpus.iterdir()}
    bpb = meta["evaluation"]["validation_bpb"]
    assert 0 < bpb < 8.5 and meta["evaluation"]["validation_bytes"] > 0
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 6 and [h["step"] for h in state["history"]] == [3, 6, 6]
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert opt["optimizer"]["state"]  # AdamW moments are there
    # the export side reads the same checkpoint; the weights load into a model that runs
    config, tensors, export_meta = read_checkpoint_weights(ckpt)
    assert config.hidden_size == 32 and export_meta["evaluation"]["validation_bpb"] == bpb
    lm = load_model(ckpt)
    assert _same(tensors, lm.state_dict())
    logits = lm(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, 258) and torch.isfinite(logits).all()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1] == {"event": "end", "stopped_by": "max-steps", "step": 6}


def test_training_lowers_validation_bits_per_byte(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert train_main([str(corpus), "--out", str(out), "--max-steps", "40", "--eval-every", "0",
                       "--dropout", "0", *TINY]) == 0
    state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    # an untrained byte model is near log2(258) = 8 bits; 40 steps on repetitive words learn a lot
    assert state["history"][-1]["val_bpb"] < 6.0


def test_same_seed_is_bit_identical_and_resume_continues_exactly(corpus: Path, tmp_path: Path) -> None:
    common = [str(corpus), "--dropout", "0.1", "--eval-every", "0", "--final-val-windows", "1", *TINY]
    assert train_main(["--out", str(tmp_path / "a"), "--max-steps", "6", *common]) == 0
    assert train_main(["--out", str(tmp_path / "b"), "--max-steps", "6", *common]) == 0
    a, b = _weights(tmp_path / "a" / "checkpoint"), _weights(tmp_path / "b" / "checkpoint")
    assert _same(a, b)
    # stop at 3 (of a 6-step schedule), then resume: the same weights as running 6 straight
    assert train_main(["--out", str(tmp_path / "c"), "--max-steps", "6", "--stop-at-step", "3", *common]) == 0
    three = _weights(tmp_path / "c" / "checkpoint")
    assert not _same(three, a)
    assert train_main(["--out", str(tmp_path / "c"), "--max-steps", "6", "--resume", *common]) == 0
    assert _same(_weights(tmp_path / "c" / "checkpoint"), a)
    state = json.loads((tmp_path / "c" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["tokens_seen"] == 6 * 2 * 96
    # a different seed gives different weights
    assert train_main(["--out", str(tmp_path / "d"), "--max-steps", "6", "--seed", "1", *common]) == 0
    assert not _same(_weights(tmp_path / "d" / "checkpoint"), a)


def test_resume_without_checkpoint_is_an_error(corpus: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert train_main([str(corpus), "--out", str(tmp_path / "r"), "--max-steps", "2", "--resume", *TINY]) == 2
    assert "--resume: no checkpoint at" in capsys.readouterr().err


def test_time_budget_stops_and_saves(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert train_main([str(corpus), "--out", str(out), "--time-budget", "1s", "--eval-every", "0",
                       "--final-val-windows", "1", *TINY]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["event"] == "end" and log[-1]["stopped_by"] == "time-budget" and log[-1]["step"] >= 1
    assert read_checkpoint_metadata(out / "checkpoint")["provenance"]["steps"] == log[-1]["step"]


def test_ctrl_c_saves_a_checkpoint_before_exiting(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "train", str(corpus), "--out", str(out), "--max-steps", "100000",
         "--eval-every", "0", "--final-val-windows", "1", *TINY],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "train_log.jsonl"
    deadline = time.monotonic() + 90
    def stepped() -> bool:  # a "step" record is logged every 10 steps
        return log.exists() and '"event": "step"' in log.read_text()

    while not stepped() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stepped(), proc.communicate()[1]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    steps = read_checkpoint_metadata(out / "checkpoint")["provenance"]["steps"]
    assert steps >= 10
    assert f"stopped (signal SIGINT) at step {steps}" in err


def test_durations_and_learning_rate_schedule() -> None:
    assert parse_duration("90") == 90 and parse_duration("90s") == 90
    assert parse_duration("80m") == 4800 and parse_duration("1.5h") == 5400
    with pytest.raises(ValueError, match="cannot read duration"):
        parse_duration("soon")
    assert lr_factor(0.0, 0, 10, 0.1) == pytest.approx(0.1)  # warm-up starts low
    assert lr_factor(0.0, 9, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(0.5, 500, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(1.0, 1000, 10, 0.1) == pytest.approx(0.1)


def test_init_from_starts_a_new_run_from_a_checkpoints_or_an_artifacts_weights(
        corpus: Path, tmp_path: Path, tiny_artifact: Path) -> None:
    source = tmp_path / "source"
    assert train_main([str(corpus), "--out", str(source), "--max-steps", "3", *TINY]) == 0
    # learning rate 0: one step leaves the weights as they were loaded, so the new run holds exactly them
    tuned = tmp_path / "tuned"
    assert train_main([str(corpus), "--out", str(tuned), "--init-from", str(source / "checkpoint"), "--max-steps",
                       "1", *TINY, "--lr", "0", "--hidden-size", "48"]) == 0  # model flags are ignored
    assert _same(_weights(tuned / "checkpoint"), _weights(source / "checkpoint"))
    assert json.loads((tuned / "checkpoint" / "trainer_state.json").read_text())["step"] == 1  # a fresh count
    from_artifact = tmp_path / "from_artifact"
    assert train_main([str(corpus), "--out", str(from_artifact), "--init-from", str(tiny_artifact),
                       "--max-steps", "1", *TINY, "--lr", "0"]) == 0
    assert _same(_weights(from_artifact / "checkpoint"), _weights(tiny_artifact))
    # a fine-tune is not a resume, and a directory that holds no model is refused
    assert train_main([str(corpus), "--out", str(tuned), "--init-from", str(source / "checkpoint"), "--resume",
                       "--max-steps", "2", *TINY]) == 2
    assert train_main([str(corpus), "--out", str(tmp_path / "x"), "--init-from", str(tmp_path),
                       "--max-steps", "1", *TINY]) == 2


def test_rehash_changes_the_hashing_of_an_init_from_model_and_nothing_else(corpus: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    assert train_main([str(corpus), "--out", str(source), "--max-steps", "2", *TINY]) == 0
    tuned = tmp_path / "tuned"
    assert train_main([str(corpus), "--out", str(tuned), "--init-from", str(source / "checkpoint"), "--rehash",
                       "128x3", "--max-steps", "1", *TINY, "--lr", "0"]) == 0
    before = read_checkpoint_metadata(source / "checkpoint")["config"]
    after = read_checkpoint_metadata(tuned / "checkpoint")["config"]
    assert (after["num_buckets"], after["num_hashes"]) == (128, 3)
    assert {k: v for k, v in after.items() if k not in ("num_buckets", "num_hashes")} == \
        {k: v for k, v in before.items() if k not in ("num_buckets", "num_hashes")}
    assert _same(_weights(tuned / "checkpoint"), _weights(source / "checkpoint"))
    auto = tmp_path / "auto"
    assert train_main([str(corpus), "--out", str(auto), "--init-from", str(source / "checkpoint"), "--rehash",
                       "auto", "--max-steps", "1", *TINY, "--lr", "0"]) == 0
    assert read_checkpoint_metadata(auto / "checkpoint")["config"]["num_buckets"] is None
    # only for a fine-tune; an odd bucket count is refused when the options are read
    assert train_main([str(corpus), "--out", str(tmp_path / "x"), "--rehash", "128", "--max-steps", "1",
                       *TINY]) == 2
    with pytest.raises(SystemExit):
        train_main([str(corpus), "--out", str(tmp_path / "y"), "--init-from", str(source / "checkpoint"),
                    "--rehash", "127", "--max-steps", "1", *TINY])
