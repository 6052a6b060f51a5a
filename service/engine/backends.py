"""Forward backends for embeddings: torch (the model itself) or onnxruntime (the artifact's model.onnx).

Decoding (prefill and decode steps with the LSH window cache) always runs on torch: the ONNX graph is the
plain forward pass and has no decode step. `/info` says which backend does what.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from model.batch import check_attention_mask
from model.decoding.cache import kv_dtype_for
from model.pooling import EmbeddingStats, pool_hidden, standardize_pooled

log = logging.getLogger("service.backends")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was asked but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The decode cache's key and value dtype for REFORMER_KV_CACHE_DTYPE: None (the model's) for auto or the
    model's own dtype, else what model.decoding.cache.kv_dtype_for accepts; anything else is refused at
    start-up."""
    if name == "auto" or DTYPES[name] == model_dtype:
        return None
    try:
        return kv_dtype_for(model_dtype, DTYPES[name])
    except ValueError:
        raise RuntimeError(f"kv_cache_dtype={name} needs a float32 model; this one is "
                           f"{str(model_dtype).removeprefix('torch.')} (use auto)") from None


def resolve_backend(name: str, device: torch.device, onnx_path: Path | None) -> str:
    """auto: torch. bench/forward/backends.py (one thread each, so neither backend's threads stall the other's)
    measured onnxruntime fp32 level with eager torch at 1K-4K tokens and 1.6x slower at 16K, and the
    service's 4K-byte /embed ran about 2x faster on torch; onnxruntime stays available by name."""
    if name == "onnxruntime" and onnx_path is None:
        raise RuntimeError("backend=onnxruntime was asked but the artifact has no model.onnx")
    if name != "auto":
        return name
    return "torch"


class EmbeddingBackend(Protocol):
    name: str

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
        """(B, L) ids and mask (left and/or right padded) -> (B, D) float32 pooled vectors on the CPU, mean-pooled
        ones standardised with the artifact's embedding statistics when the backend was given them."""
        ...


class TorchBackend:
    name = "torch"

    def __init__(self, model: torch.nn.Module, device: torch.device, stats: EmbeddingStats | None = None):
        self.model = model
        self.device = device
        self.stats = stats

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
        vectors = self.model.embed(  # type: ignore[operator]
            input_ids.to(self.device), attention_mask=attention_mask.to(self.device), pooling=pooling
        )
        return standardize_pooled(vectors.float().cpu(), pooling, self.stats)


class OnnxBackend:
    name = "onnxruntime"

    def __init__(self, onnx_path: Path, device: torch.device, stats: EmbeddingStats | None = None):
        import onnxruntime as ort

        self.stats = stats
        options = ort.SessionOptions()
        # One worker thread owns the model; let ORT use the cores it is given (OMP_NUM_THREADS if set).
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0:
            options.intra_op_num_threads = threads
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self.session = ort.InferenceSession(str(onnx_path), sess_options=options, providers=providers)
        self.outputs = [o.name for o in self.session.get_outputs()]
        log.info("onnxruntime session on %s with providers %s", onnx_path, self.session.get_providers())

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
        feeds = {
            "input_ids": input_ids.cpu().numpy().astype(np.int64),
            "attention_mask": attention_mask.cpu().numpy().astype(np.int64),
        }
        check_attention_mask(attention_mask)  # the graph cannot raise: refuse masks with holes here, as torch does
        hidden = self.session.run(["hidden_states"], feeds)[0]
        return pool_hidden(torch.from_numpy(np.asarray(hidden, dtype=np.float32)), attention_mask.cpu(), pooling,
                           stats=self.stats)
