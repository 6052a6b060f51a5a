"""Helpers shared by the export tests."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from tests.conftest import tiny_model


def write_checkpoint(directory: Path, seed: int = 0, with_metadata: bool = True) -> Path:
    """A checkpoint as the trainer writes it: weights with the config (and run records) in the metadata."""
    model = tiny_model(seed=seed)
    directory.mkdir(parents=True)
    metadata = {"config": json.dumps(model.config.to_dict())}
    if with_metadata:
        metadata["provenance"] = json.dumps({"data": {"books.txt": "ab" * 32}, "steps": 12, "seed": 3,
                                             "command": "reformer train books.txt --out run"})
        metadata["evaluation"] = json.dumps({"val_bits_per_byte": 7.9})
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata=metadata)
    (directory / "trainer_state.json").write_text(json.dumps({"step": 12}))
    return directory
