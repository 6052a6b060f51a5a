"""The one reader of training checkpoints, used by `reformer export` and by `reformer train --resume`.

A checkpoint is a directory (or the file itself) with `model.safetensors`, whose safetensors metadata
holds the config JSON under "config" and optionally "format", "provenance" and "evaluation" JSON
strings (train/checkpoint.py writes it). Read with safetensors only: nothing is unpickled (the
optimiser state beside it is the trainer's business, not the reader's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from model import ReformerConfig, ReformerLM

WEIGHTS_FILE = "model.safetensors"


class CheckpointError(Exception):
    """A checkpoint that cannot be read; the message names the file."""


def checkpoint_weights_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / WEIGHTS_FILE
    if not p.is_file():
        raise CheckpointError(f"{p}: no such checkpoint file (expected a directory with {WEIGHTS_FILE} or the file)")
    return p


def _read(path: str | Path, tensors: bool) -> tuple[ReformerConfig, dict[str, torch.Tensor], dict[str, Any]]:
    p = checkpoint_weights_path(path)
    try:
        with safe_open(str(p), framework="pt", device="cpu") as f:
            raw = dict(f.metadata() or {})
            state = {name: f.get_tensor(name) for name in f.keys()} if tensors else {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{p}: cannot be read as safetensors ({e})") from e
    if "config" not in raw:
        raise CheckpointError(f"{p}: safetensors metadata has no 'config' entry (not a reformer checkpoint)")
    metadata: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            metadata[key] = json.loads(value)
        except json.JSONDecodeError:
            metadata[key] = value
    if not isinstance(metadata["config"], dict):
        raise CheckpointError(f"{p}: metadata 'config' is not a JSON object")
    try:
        config = ReformerConfig.from_dict(metadata["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{p}: metadata 'config' is not a valid model configuration ({e})") from e
    return config, state, metadata


def read_checkpoint_weights(path: str | Path) -> tuple[ReformerConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """-> (config, state dict, metadata) where metadata holds the decoded JSON of every metadata entry
    (strings that are not JSON are kept as strings)."""
    return _read(path, tensors=True)


def read_checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """The decoded metadata only (config, provenance, evaluation, format); no tensor is read."""
    return _read(path, tensors=False)[2]


def load_checkpoint_model(path: str | Path) -> ReformerLM:
    """The checkpoint's model in eval mode."""
    config, state, _ = read_checkpoint_weights(path)
    lm = ReformerLM(config)
    try:
        lm.load_state_dict(state)
    except RuntimeError as e:
        raise CheckpointError(f"{checkpoint_weights_path(path)}: weights do not fit the config ({e})") from e
    return lm.eval()
