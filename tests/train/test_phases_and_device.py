"""Phases (window x batch schedules split by steps or wall time), the validation curve file, the
reversible/plain choice, and everything about `reformer train --device cuda --bf16` that can be checked
without a GPU: argument handling, autocast dtype, device placement, the DDP backend."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from model import ReformerConfig, ReformerLM
from train import step as step_mod
from train.loop import main as train_main
from train.loop import pick_device
from train.phases import Phase, parse_phases, phase_at
from train.runtime import DistInfo, ddp_backend
from train.step import autocast_dtype, choose_reversible

from .test_train import TINY, corpus  # noqa: F401  (fixture)


def test_phases_parse_shares_and_refuse_bad_text() -> None:
    assert parse_phases("512x16:70%,4096x2:30%") == [Phase(512, 16, 0.7), Phase(4096, 2, 0.3)]
    assert parse_phases("128x4") == [Phase(128, 4, 1.0)]
    assert parse_phases("64x2:0.25, 128x1:0.75") == [Phase(64, 2, 0.25), Phase(128, 1, 0.75)]
    for bad, words in [("512x16:70%,4096x2:20%", "add up"), ("512:70%", "WINDOWxBATCH"),
                       ("512x16,4096x2:30%", "needs a share"), ("512x0", "batch"), ("", "empty")]:
        with pytest.raises(ValueError, match=words):
            parse_phases(bad)
    phases = parse_phases("64x2:25%,128x1:75%")
    assert [phase_at(phases, p) for p in (0.0, 0.2499, 0.25, 0.9, 1.0, 1.5)] == [0, 0, 1, 1, 1, 1]


def test_phased_run_switches_window_and_writes_the_curve(corpus: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "run"
    args = [a for a in TINY]
    i = args.index("--window")
    del args[i:i + 4]  # --window 96 --batch-size 2: the phases give them
    rc = train_main([str(corpus), "--out", str(out), "--max-steps", "6", "--eval-every", "2",
                     "--phases", "32x3:50%,96x1:50%", "--val-window", "64", *args])
    assert rc == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    phases = [r for r in log if r["event"] == "phase"]
    assert [(r["phase"], r["window"], r["batch_size"], r["step"]) for r in phases] == [(0, 32, 3, 0), (1, 96, 1, 3)]
    assert all(r["reversible"] is False for r in phases)  # auto: tiny activations fit, plain autograd
    rows = list(csv.DictReader((out / "curve.csv").open()))
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 6]
    assert int(rows[-1]["tokens_seen"]) == 3 * 32 * 3 + 3 * 96
    assert [int(r["phase"]) for r in rows] == [0, 1, 1, 1]
    assert all(float(r["val_bpb"]) > 0 for r in rows)


def test_reversible_auto_follows_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    lm = ReformerLM(ReformerConfig(hidden_size=32, num_attention_heads=2, attention_head_size=16,
                                   axial_pos_embds_dim=(16, 16), feed_forward_size=64))
    cpu = torch.device("cpu")
    need = step_mod.activation_bytes(lm, 2, 1024)
    monkeypatch.setattr(step_mod, "available_memory_bytes", lambda: 4 * need)
    assert choose_reversible("auto", lm, 2, 1024, cpu) is False
    monkeypatch.setattr(step_mod, "available_memory_bytes", lambda: 4 * need - 4)
    assert choose_reversible("auto", lm, 2, 1024, cpu) is True
    assert choose_reversible("on", lm, 1, 8, cpu) is True and choose_reversible("off", lm, 64, 65536, cpu) is False


def test_gpu_choices_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert autocast_dtype(torch.device("cuda", 0), bf16=True) is torch.bfloat16
    assert autocast_dtype(torch.device("cuda", 0), bf16=False) is None
    assert autocast_dtype(torch.device("cpu"), bf16=True) is None
    assert pick_device("cuda", DistInfo(rank=3, world_size=4, local_rank=1)) == torch.device("cuda", 1)
    assert pick_device("cpu", DistInfo(rank=1, world_size=2, local_rank=1)) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto", DistInfo(local_rank=0)) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto", DistInfo()) == torch.device("cpu")
    assert ddp_backend("cuda") == "nccl" and ddp_backend("cpu") == "gloo"


def test_device_cuda_without_cuda_is_a_clear_usage_error(corpus: Path, tmp_path: Path,  # noqa: F811
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = train_main([str(corpus), "--out", str(tmp_path / "run"), "--max-steps", "1", "--device", "cuda",
                     "--bf16", *TINY])
    assert rc == 2
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err


def test_bf16_on_cpu_trains_in_fp32_with_a_note(corpus: Path, tmp_path: Path,  # noqa: F811
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc = train_main([str(corpus), "--out", str(tmp_path / "run"), "--max-steps", "1", "--eval-every", "0",
                     "--final-val-windows", "1", "--bf16", "--device", "cpu", *TINY])
    assert rc == 0
    assert "--bf16 applies to CUDA only" in capsys.readouterr().err


def test_loss_fn_is_the_trainers_cross_entropy_and_compile_wraps_it() -> None:
    torch.manual_seed(0)
    lm = ReformerLM(ReformerConfig(hidden_size=32, num_attention_heads=2, attention_head_size=16,
                                   axial_pos_embds_dim=(16, 16), feed_forward_size=64, num_buckets=4,
                                   axial_pos_shape=(16, 64), max_position_embeddings=1024)).train()
    ids = torch.randint(2, 258, (2, 33))
    loss = step_mod.make_loss_fn(lm, None, "cpu")(ids, 0)
    logits = lm(ids[:, :-1]).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 258), ids[:, 1:].reshape(-1))
    assert torch.allclose(loss, ref)
    compiled = step_mod.make_loss_fn(lm, None, "cpu", compile=True)  # compiles lazily, on the first call
    assert callable(compiled) and compiled is not step_mod.make_loss_fn
