"""Successor-value heads in the ONNX graph (export/onnx_graph.py): the static forward the graph traces equals
the eager forward for models with them, and the exported graph run by onnxruntime equals torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from export import onnx_export as ox
from export.onnx_graph import static_forward
from tests.conftest import tiny_model


def _batch(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.randint(3, 40, (len(lengths), longest), generator=g)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, longest - n:] = 1  # left padding: the graph's own batch preparation moves it
    return ids, mask


LAYERS = ["lsh", "local", "lsh"]


@pytest.mark.parametrize("successor, layers", [(1, None), (2, None), ([0, 2], LAYERS), ([1, 2], LAYERS)])
@pytest.mark.parametrize("lengths", [[5], [8], [40, 13], [64, 3, 29]])
def test_static_forward_equals_eager_with_successor_heads(successor: int | list[int], layers: list[str] | None,
                                                          lengths: list[int]) -> None:
    lm = tiny_model(lsh_successor_heads=successor, attn_layers=layers or ["local", "lsh"])
    ids, mask = _batch(lengths)
    with torch.no_grad():
        logits, _ = static_forward(lm, ids, mask)
        for i, n in enumerate(lengths):
            alone = lm(ids[i : i + 1, ids.shape[1] - n:]).logits[0]  # the row alone
            assert (logits[i, ids.shape[1] - n:] - alone).abs().max().item() <= 1e-4


def test_the_successor_heads_change_the_graphs_output() -> None:
    """The test above can fail: a graph that ignored the heads would give the plain model's logits."""
    ids, mask = _batch([40, 13])
    with torch.no_grad():
        plain, _ = static_forward(tiny_model(), ids, mask)
        successor, _ = static_forward(tiny_model(lsh_successor_heads=2), ids, mask)
    assert (plain - successor).abs().max().item() > 10 * ox.PARITY_TOLERANCE


def test_onnx_graph_equals_torch_with_successor_heads(tmp_path: Path) -> None:
    lm = tiny_model(lsh_successor_heads=[2, 1], attn_layers=LAYERS)
    path = tmp_path / "model.onnx"
    ox.export_onnx(lm, path, optimize=False)
    found = ox.verify_onnx(lm, path, seed=3)
    assert found["max_abs_diff_logits"] <= ox.PARITY_TOLERANCE, found
