"""Dynamic int8 quantisation of the ONNX graph, and the validation bits per byte of both graphs, so the
manifest says what the speed costs in quality."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model import ByteTokenizer, ReformerLM
from model.tokenizer import Tokenizer

from .onnx_export import max_export_length
from .onnx_run import ort_session

log = logging.getLogger(__name__)

# Held-out text for when no evaluation data is given: public-domain prose (the Gettysburg Address and
# the opening of the US Declaration of Independence), which no model of this project trains on.
BUILTIN_EVAL_TEXT = (
    b"Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    b"Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
    b"civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We "
    b"are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final "
    b"resting place for those who here gave their lives that that nation might live. It is altogether fitting "
    b"and proper that we should do this. But, in a larger sense, we can not dedicate -- we can not consecrate "
    b"-- we can not hallow -- this ground. The brave men, living and dead, who struggled here, have consecrated "
    b"it, far above our poor power to add or detract. The world will little note, nor long remember what we say "
    b"here, but it can never forget what they did here. It is for us the living, rather, to be dedicated here "
    b"to the unfinished work which they who fought here have thus far so nobly advanced. It is rather for us to "
    b"be here dedicated to the great task remaining before us -- that from these honored dead we take "
    b"increased devotion to that cause for which they gave the last full measure of devotion -- that we here "
    b"highly resolve that these dead shall not have died in vain -- that this nation, under God, shall have a "
    b"new birth of freedom -- and that government of the people, by the people, for the people, shall not "
    b"perish from the earth.\n\n"
    b"When in the Course of human events, it becomes necessary for one people to dissolve the political bands "
    b"which have connected them with another, and to assume among the powers of the earth, the separate and "
    b"equal station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the "
    b"opinions of mankind requires that they should declare the causes which impel them to the separation. "
    b"We hold these truths to be self-evident, that all men are created equal, that they are endowed by their "
    b"Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of "
    b"Happiness.\n"
)


def read_eval_data(directory: Path, max_bytes_per_file: int = 32768) -> bytes:
    """The last `max_bytes_per_file` bytes of every *.txt file under `directory` (training holds out the
    tail of each document, so the tail is the validation text), joined by blank lines."""
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: no such evaluation file or directory")
    files = sorted(p for p in directory.rglob("*.txt") if p.is_file()) if directory.is_dir() else [directory]
    if not files:
        raise FileNotFoundError(f"{directory}: no *.txt files to evaluate on")
    parts = []
    for p in files:
        data = p.read_bytes().replace(b"\r\n", b"\n")
        parts.append(data[-max_bytes_per_file:])
    return b"\n\n".join(parts)


def byte_ids(text: bytes, tokenizer: ByteTokenizer) -> list[int]:
    """Token ids of raw bytes (a cut through a multi-byte character stays the bytes it is)."""
    return [b + tokenizer.offset for b in text]


def text_ids(text: bytes, tokenizer: Tokenizer) -> tuple[list[int], float]:
    """(token ids of `text`, bytes per token): the bytes themselves for a byte tokenizer, else the tokenizer's
    encoding of the text as UTF-8 (bits per token divided by bytes per token is bits per byte)."""
    if isinstance(tokenizer, ByteTokenizer):
        return byte_ids(text, tokenizer), 1.0
    ids = tokenizer.encode(text.decode("utf-8", errors="replace"))
    return ids, len(text) / max(len(ids), 1)


def eval_windows(ids: list[int], window: int) -> list[list[int]]:
    """Consecutive non-overlapping windows; each predicts its tokens after the first."""
    return [ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1]


def _bits(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum of -log2 p(target) for (L, V) logits."""
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].sum() / math.log(2))


def bits_per_byte_onnx(path: Path, text: bytes, tokenizer: Tokenizer, window: int) -> float:
    """Validation bits per byte of an ONNX graph (windows of `window` tokens)."""
    session = ort_session(path)
    ids, bytes_per_token = text_ids(text, tokenizer)
    total, count = 0.0, 0
    for w in eval_windows(ids, window):
        x = np.asarray([w], dtype=np.int64)
        (logits,) = session.run(["logits"], {"input_ids": x, "attention_mask": np.ones_like(x)})
        total += _bits(logits[0, :-1], np.asarray(w[1:]))
        count += len(w) - 1
    return total / max(count, 1) / bytes_per_token


def bits_per_byte_torch(model: ReformerLM, text: bytes, tokenizer: Tokenizer, window: int) -> float:
    ids, bytes_per_token = text_ids(text, tokenizer)
    total, count = 0.0, 0
    with torch.no_grad():
        for w in eval_windows(ids, window):
            logits = model(torch.tensor([w])).logits[0, :-1].numpy()
            total += _bits(logits, np.asarray(w[1:]))
            count += len(w) - 1
    return total / max(count, 1) / bytes_per_token


def quantize_int8(src: Path, dst: Path) -> None:
    """Weights int8 (per tensor), activations quantised on the fly: MatMul/Gemm with constant weights.
    The hashing Einsum and the attention score MatMuls (two activations) stay fp32, so the buckets do
    not move with quantisation noise."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(src, dst, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"],
                     extra_options={"MatMulConstBOnly": True})


def quantize_and_evaluate(model: ReformerLM, onnx_path: Path, int8_path: Path, tokenizer: Tokenizer,
                          eval_text: bytes | None = None, window: int = 4096) -> tuple[dict[str, Any], dict[str, Any]]:
    """Quantise, then measure bits per byte of both graphs on the evaluation text, in windows as long as
    the training default (4096 bytes, or the model's maximum). Returns (export record, evaluation record)
    for the manifest."""
    quantize_int8(onnx_path, int8_path)
    text = eval_text if eval_text else BUILTIN_EVAL_TEXT
    window = min(window, max_export_length(model))
    fp32 = bits_per_byte_onnx(onnx_path, text, tokenizer, window)
    int8 = bits_per_byte_onnx(int8_path, text, tokenizer, window)
    log.info("int8: %.4f -> %.4f bits per byte", fp32, int8)
    export = {"file": int8_path.name, "method": "onnxruntime quantize_dynamic, QInt8 weights, MatMul/Gemm"}
    evaluation = {
        "text": "builtin" if not eval_text else "eval-data",
        "bytes": len(text),
        "window": window,
        "bits_per_byte_fp32": fp32,
        "bits_per_byte_int8": int8,
        "bits_per_byte_change": int8 - fp32,
    }
    return export, evaluation
