"""`reformer train --key-conv`: n-gram keys added to an --init-from model (every weight kept, the new
convolution starting as the identity), trained into the checkpoint, and a resume that keeps the checkpoint's
width."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from export.checkpoint import load_checkpoint_model
from train.checkpoint import read_checkpoint_metadata
from train.loop import main as train_main

from .helpers import TINY, repeated_corpus


def test_init_from_adds_the_convolution_and_trains_it(tmp_path: Path) -> None:
    corpus = repeated_corpus(tmp_path)
    assert train_main([str(corpus), "--out", str(tmp_path / "plain"), "--max-steps", "1", *TINY]) == 0
    plain_dir = tmp_path / "plain" / "checkpoint"
    run = tmp_path / "conv"
    common = [str(corpus), "--out", str(run), "--init-from", str(plain_dir), "--key-conv", "3", "--max-steps", "2",
              "--lr", "1e-2", *TINY]
    assert train_main([*common, "--stop-at-step", "1"]) == 0
    assert read_checkpoint_metadata(run / "checkpoint")["config"]["lsh_key_conv_width"] == 3
    trained = load_checkpoint_model(run / "checkpoint")
    taps = [p for n, p in trained.named_parameters() if ".key_conv." in n]
    identity = torch.zeros_like(taps[0])
    identity[:, 0, -1] = 1.0
    assert len(taps) == 1 and not torch.equal(taps[0], identity)  # one LSH layer; a step moved its taps
    plain = load_checkpoint_model(plain_dir)
    assert plain.config.lsh_key_conv_width == 0
    resume = [str(corpus), "--out", str(run), "--max-steps", "2", "--resume", *TINY]
    assert train_main([*resume, "--key-conv", "4"]) == 2  # a resumed run keeps its model's width
    assert train_main([*resume, "--key-conv", "3"]) == 0


def test_a_negative_width_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = repeated_corpus(tmp_path)
    assert train_main([str(corpus), "--out", str(tmp_path / "a"), "--max-steps", "1", "--key-conv", "-1",
                       *TINY]) == 2
    assert "--key-conv: lsh_key_conv_width must be an integer >= 0, got -1" in capsys.readouterr().err
