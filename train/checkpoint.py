"""Training checkpoints: a directory holding

- `model.safetensors`: the weights; metadata keys `format`, `config` (ReformerConfig JSON), `provenance` (data
  files and sha256, steps, tokens seen, wall time, seed, command line, code version) and `evaluation`
  (validation bits per byte), all JSON strings. `reformer export` turns it into a served artifact.
- `optimizer.pt`: the optimizer's state (`torch.load(..., weights_only=True)` reads it).
- `trainer_state.json`: where training stands (step, tokens seen, wall time, the arguments).

A checkpoint is written into a temporary directory and renamed into place, so an interrupted save never
leaves a half-written checkpoint behind. It is read back only through `export.checkpoint`, the one
reader, by `reformer export` and by `reformer train --resume` alike."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from export.checkpoint import load_checkpoint_model, read_checkpoint_metadata, read_checkpoint_weights
from export.documents import DataError
from model.reformer import ReformerLM

__all__ = ["TrainerState", "code_version", "load_model", "load_training_state", "read_checkpoint_metadata",
           "save_checkpoint"]

CHECKPOINT_FORMAT = "reformer-train-checkpoint/1"
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    step: int = 0
    tokens_seen: int = 0
    wall_time_s: float = 0.0
    seed: int = 0
    last_val_bpb: float | None = None
    stage_floor: int = 0  # the long-range curriculum's stage reached early (train/recipe.py --advance-at)
    history: list[dict[str, Any]] = field(default_factory=list)  # validation results over time

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def code_version() -> str:
    """The package version plus the git commit of the source tree (with `-dirty` for local changes)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pkg = version("reformer-serve")
    except PackageNotFoundError:
        pkg = "unknown"
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=root,
                                capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "no-git"
    return f"{pkg}+{commit}"


def save_checkpoint(path: Path, lm: ReformerLM, optimizer: torch.optim.Optimizer, state: TrainerState,
                    provenance: dict[str, Any], evaluation: dict[str, Any], args: dict[str, Any]) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in lm.state_dict().items()}
    metadata = {
        "format": CHECKPOINT_FORMAT,
        "config": json.dumps(lm.config.to_dict(), sort_keys=True),
        "provenance": json.dumps(provenance, sort_keys=True),
        "evaluation": json.dumps(evaluation, sort_keys=True),
    }
    save_file(weights, str(tmp / WEIGHTS_FILE), metadata=metadata)
    torch.save({"optimizer": optimizer.state_dict()}, tmp / OPTIMIZER_FILE)
    (tmp / STATE_FILE).write_text(json.dumps({**state.to_dict(), "args": args}, indent=2) + "\n")
    old = path.with_name(path.name + ".old")
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        shutil.rmtree(old)
    return path


def load_model(path: Path) -> ReformerLM:
    """The checkpoint's model (train mode off), read by export's one checkpoint reader."""
    return load_checkpoint_model(path)


def load_init_weights(lm: ReformerLM, init: ReformerLM) -> None:
    """--init-from's weights into `lm`. A key convolution `lm` has and `init` lacks (--key-conv) keeps its
    identity start; every other weight must be there."""
    missing, unexpected = lm.load_state_dict(init.state_dict(), strict=False)
    missing = [k for k in missing if ".key_conv." not in k]
    if missing or unexpected:
        raise DataError(f"--init-from: weights missing {missing} or unexpected {unexpected} for this model")


def load_training_state(path: Path, lm: ReformerLM, optimizer: torch.optim.Optimizer) -> TrainerState:
    """Restore weights and optimizer in place (the learning rate is a function of the step); return the
    trainer state."""
    path = Path(path)
    _, weights, _ = read_checkpoint_weights(path)
    lm.load_state_dict(weights)
    opt_state = torch.load(path / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
    optimizer.load_state_dict(opt_state["optimizer"])
    raw = json.loads((path / STATE_FILE).read_text())
    raw.pop("args", None)
    return TrainerState(**raw)
