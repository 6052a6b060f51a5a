"""`reformer train --successor-heads`: a new model with successor-value heads, an --init-from model converted
(every weight kept), and a resume that keeps the checkpoint's heads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from model import ReformerLM
from train.checkpoint import read_checkpoint_metadata
from train.loop import main as train_main
from train.options import build_parser, init_config, parse_successor_heads

from .helpers import TINY, repeated_corpus


def test_counts_parse_as_one_for_every_layer_or_one_per_layer() -> None:
    assert parse_successor_heads("4") == 4 and parse_successor_heads("4,2") == [4, 2]
    for bad in ("x", "-1", "2,-1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_successor_heads(bad)


def test_init_from_converts_heads_keeping_every_weight(tmp_path: Path) -> None:
    corpus = repeated_corpus(tmp_path)
    assert train_main([str(corpus), "--out", str(tmp_path / "plain"), "--max-steps", "1", *TINY]) == 0
    plain_dir = tmp_path / "plain" / "checkpoint"
    plain_cfg = read_checkpoint_metadata(plain_dir)["config"]
    assert plain_cfg["lsh_successor_heads"] == 0
    from export.checkpoint import load_checkpoint_model

    plain = load_checkpoint_model(plain_dir)
    args = build_parser().parse_args([str(corpus), "--out", "x", "--successor-heads", "1"])
    converted = ReformerLM(init_config(plain.config, args)).eval()
    converted.load_state_dict(plain.state_dict())  # strict: the conversion adds and drops no weight
    assert converted.config.lsh_successor_heads == 1
    x = torch.randint(2, 258, (1, 48))
    with torch.no_grad():
        assert not torch.allclose(converted(x).logits, plain(x).logits)  # the converted head reads v[s + 1]
        same = ReformerLM(init_config(plain.config, build_parser().parse_args([str(corpus), "--out", "x"]))).eval()
        same.load_state_dict(plain.state_dict())
        assert torch.equal(same(x).logits, plain(x).logits)  # without the option: the model itself

    run = tmp_path / "converted"
    common = [str(corpus), "--out", str(run), "--init-from", str(plain_dir), "--successor-heads", "1",
              "--max-steps", "2", *TINY]
    assert train_main([*common, "--stop-at-step", "1"]) == 0
    assert read_checkpoint_metadata(run / "checkpoint")["config"]["lsh_successor_heads"] == 1
    resume = [str(corpus), "--out", str(run), "--max-steps", "2", "--resume", *TINY]
    assert train_main([*resume, "--successor-heads", "2"]) == 2  # a resumed run keeps its model's heads
    assert train_main([*resume, "--successor-heads", "1"]) == 0
    assert json.loads((run / "checkpoint" / "trainer_state.json").read_text())["step"] == 2


def test_new_model_takes_the_counts_and_refuses_too_many(tmp_path: Path) -> None:
    corpus = repeated_corpus(tmp_path)
    assert train_main([str(corpus), "--out", str(tmp_path / "a"), "--max-steps", "1", "--successor-heads", "2",
                       *TINY]) == 0
    assert read_checkpoint_metadata(tmp_path / "a" / "checkpoint")["config"]["lsh_successor_heads"] == 2
    assert train_main([str(corpus), "--out", str(tmp_path / "b"), "--max-steps", "1", "--successor-heads", "3",
                       *TINY]) == 2  # more than the model's two heads: refused by name
    assert train_main([str(corpus), "--out", str(tmp_path / "c"), "--max-steps", "1", "--successor-heads", "1,1",
                       *TINY]) == 2  # two counts for one LSH layer
