"""Running an exported graph in onnxruntime and comparing its outputs with torch's: the session, the run
(with torch's mask check), the strict tolerance and the whole-input figures. Shared by the export
(onnx_export.py), its tie-aware check (onnx_ties.py) and the int8 evaluation (quantize.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from model.batch import check_attention_mask
from model.pooling import pool_hidden

PARITY_TOLERANCE = 1e-4
INPUT_NAMES = ["input_ids", "attention_mask"]
OUTPUT_NAMES = ["logits", "hidden_states"]


class ExportError(Exception):
    """The model cannot be exported, or its graph does not reproduce torch."""


def ort_session(path: Path, threads: int = 0) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_ort(session: Any, ids: Tensor, mask: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Run the graph; a mask with a hole is refused (ValueError naming the row), as torch refuses it."""
    check_attention_mask(mask)
    logits, hidden = session.run(OUTPUT_NAMES, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    return logits, hidden


def whole_input_parity(ids: Tensor, mask: Tensor, ref_logits: np.ndarray, ref_hidden: np.ndarray,
                       logits: np.ndarray, hidden: np.ndarray) -> dict[str, Any]:
    """What a case's outputs say about the input as a whole, all rows (recorded for hashing cases, not gated):
    relative differences of the mean next-token negative log-likelihood of the real tokens and of each row's
    mean-pooled hidden state (model/pooling.py pool_hidden, as the service pools; the worst row), the
    largest logit difference and the share of real positions within PARITY_TOLERANCE."""
    real = mask.bool().numpy()
    gap = np.abs(logits - ref_logits).max(axis=-1)[real]  # (real positions,)
    nll = []
    for out in (ref_logits, logits):
        logp = torch.log_softmax(torch.from_numpy(out[:, :-1]).double(), dim=-1)  # (B, L-1, vocab)
        target = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, L-1)
        scored = torch.from_numpy(real[:, 1:] & real[:, :-1])
        nll.append(float(-target[scored].mean()))
    a, b = (pool_hidden(torch.from_numpy(h).double(), mask, "mean") for h in (ref_hidden, hidden))  # (B, 2*hidden)
    pooled = (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-30)  # (B,)
    return {"length": int(ids.shape[1]), "nll_relative_diff": abs(nll[1] - nll[0]) / max(abs(nll[0]), 1e-30),
            "pooled_relative_diff": float(pooled.max()), "max_abs_diff_logits": float(gap.max()),
            "share_within_tolerance": float((gap <= PARITY_TOLERANCE).mean())}
