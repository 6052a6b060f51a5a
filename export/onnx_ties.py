"""The tie-aware check of an exported graph against the eager model: it tells an LSH hash near-tie, which
float rounding flips between any two implementations, from an error in the graph.

An LSH bucket is an argmax over rotated projections. Where a position's two best projections lie within
~1e-7 (relative) of each other, onnxruntime's rounding can pick the other one (its input to the hash
already differs from torch's by that much); the sorted order then moves by one slot and many logits move,
some by whole units. Whole-input figures (mean log-likelihood, pooled state) cannot tell that from a
graph error: a graph whose second LSH layer swaps two hash rounds' rotations passes them. So each case
that hashes runs a second graph besides the shipped one: the same graph with each LSH layer's sort reading
its buckets from an input, fed torch's buckets, and each layer's own hash result as an extra output
(export/onnx_buckets.py finds the bucket tensors by structure). Fed torch's buckets, a layer's hash sees
what torch's saw up to rounding (a flip in the first LSH layer would otherwise move every later layer's
hash input), and the run gives two checks:

1. **Decisions.** Every real position's bucket, per LSH layer, head and round, is compared with the eager
   model's. A decision that differs is accepted only when torch's two best rotated values (over [x, -x],
   of the factor whose digit differs) are within TIE_MARGIN of each other, relative to the best: a
   near-tie. It is recorded (layer, round, head, row, position, margin, both buckets).
2. **The rest of the graph.** Logits and hidden states must agree with the eager model at every real
   position within FED_ATOL + FED_RTOL x s, s the largest |torch| value of that position's logits (or
   hidden state): a matrix product's rounding scales with its whole output vector, not with one entry.

The whole-input figures of the shipped graph's run (onnx_run.whole_input_parity) are recorded beside them,
not gated. A case that does not hash (the eager model attends densely: no row longer than one LSH chunk)
is held to onnx_run.PARITY_TOLERANCE on the shipped graph's outputs."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import Tensor, nn

from model import ReformerLM
from model.attention import LSHSelfAttention, split_heads
from model.lsh.hashing import bucket_factors, hash_rotations, padding_bucket, rotation_size
from model.reversible import ReformerLayer

from .onnx_buckets import FED_INPUT, HASH_OUTPUT, find_bucket_sites, session_for, with_buckets_fed
from .onnx_run import OUTPUT_NAMES, PARITY_TOLERANCE, ExportError, ort_session, run_ort, whole_input_parity

TIE_MARGIN = 1e-5  # relative gap of torch's two best rotated values under which a flipped decision is a near-tie
# with torch's buckets fed: |onnx - torch| <= FED_ATOL + FED_RTOL * (largest |torch| of the position's vector)
FED_ATOL, FED_RTOL = 1e-4, 1e-5
MARGIN_BLOCK = 4096  # flipped decisions whose margins are computed at once (memory: block x rotations)


@dataclass
class TorchHash:
    """One LSH layer's hash in the eager forward."""

    layer: int  # the layer's index in the model (config.attn_layers)
    qk: Tensor  # (B, H, L_e, D) float32: the hash's input
    buckets: Tensor | None  # (B, H, R, L_e) int64; None where the layer attended densely (no hash)


@contextmanager
def capture_hashes(model: ReformerLM) -> Iterator[list[TorchHash]]:
    """Record every LSH layer's hash input and buckets during the eager forwards run inside, in layer order
    (a forward hook on each layer: its output carries the buckets it used)."""
    records: list[TorchHash] = []
    handles = []
    for index, layer in enumerate(model.layers):
        assert isinstance(layer, ReformerLayer)
        att = layer.attention.self_attention
        if not isinstance(att, LSHSelfAttention):
            continue

        def hook(module: nn.Module, args: tuple[Any, ...], output: tuple[Tensor, Tensor | None],
                 index: int = index, att: LSHSelfAttention = att) -> None:
            qk = split_heads(att.query_key(args[0]), att.heads, att.head_size).float()  # as `hash` reads it
            records.append(TorchHash(index, qk, output[1]))

        handles.append(att.register_forward_hook(hook))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def static_layout(buckets: Tensor, real_length: Tensor, padded: int, pad_bucket: int) -> np.ndarray:
    """Eager buckets (B, H, R, L_e) -> the graph's layout (B, H, R, padded): the same right-padded rows (both
    move each row's real tokens to its start), padding positions in the padding bucket as the graph puts
    them."""
    b, h, r, length = buckets.shape
    out = torch.full((b, h, r, padded), pad_bucket, dtype=torch.long)
    n = min(length, padded)
    out[..., :n] = buckets[..., :n]
    real = torch.arange(padded).view(1, padded) < real_length.view(b, 1)  # (B, padded)
    return out.masked_fill(~real[:, None, None, :], pad_bucket).numpy()


def decision_margins(qk: Tensor, rotations: Tensor, factors: list[int], flips: np.ndarray, ours: np.ndarray,
                     theirs: np.ndarray) -> np.ndarray:
    """Torch's relative top-two margin of each flipped decision: flips (N, 4) of (row, head, round, position),
    ours/theirs (N,) the two buckets. Per factor, the gap between the two best of [x, -x] over the best's
    magnitude, in float64 from torch's fp32 hash input; a decision's margin is that of the factor (the
    largest, if several) whose digit differs."""
    b, h, r, p = (torch.from_numpy(flips[:, i]) for i in range(4))
    k_all = rotations.shape[-1]
    x = qk[b, h, p].double()  # (N, D)
    rot = rotations.double().permute(0, 2, 1, 3)[h, r]  # (N, D, K)
    values = torch.bmm(x.unsqueeze(1), rot).squeeze(1)  # (N, K)
    assert values.shape[-1] == k_all
    margin = torch.zeros(len(flips), dtype=torch.float64)
    start, scale = 0, 1
    for f in factors:
        part = values[:, start : start + f // 2]
        top = torch.cat([part, -part], dim=-1).topk(2, dim=-1).values  # (N, 2)
        gap = (top[:, 0] - top[:, 1]) / top[:, 0].abs().clamp_min(1e-30)
        differs = torch.from_numpy((ours // scale) % f != (theirs // scale) % f)
        margin = torch.where(differs, torch.maximum(margin, gap), margin)
        start, scale = start + f // 2, scale * f
    return margin.numpy()


def prepared_length(model: ReformerLM, length: int) -> int:
    """The graph's padded length for `length` tokens (model/batch.py prepare_batch, static)."""
    multiple = math.lcm(*model.config.chunk_lengths())
    return (length + multiple - 1) // multiple * multiple


def _worst(out: np.ndarray, ref: np.ndarray, real: np.ndarray) -> float:
    return float(np.abs(out - ref)[real].max())


class TieCheck:
    """The graph at `path`, prepared for the tie-aware check: its bucket tensors found; it and the graph fed
    torch's buckets opened in onnxruntime."""

    def __init__(self, model: ReformerLM, path: Path) -> None:
        self.model, self.path = model, path
        graph = onnx.load(str(path))
        self.lsh_layers = [i for i, kind in enumerate(model.config.attn_layers) if kind == "lsh"]
        sites = find_bucket_sites(graph, len(self.lsh_layers))
        self.shipped = ort_session(path)
        self.fed = session_for(with_buckets_fed(graph, sites)) if sites else None
        self.hash_outputs = [HASH_OUTPUT.format(i) for i in range(len(sites))]
        nb = model.config.num_buckets
        assert nb is not None  # export refuses automatic bucket counts
        self.factors = bucket_factors(nb)
        self.pad_bucket = padding_bucket(nb)
        cfg = model.config
        self.rotations = hash_rotations(cfg.hash_seed, cfg.num_attention_heads, cfg.attention_head_size,
                                        cfg.num_hashes, rotation_size(nb)).view(
            cfg.num_attention_heads, cfg.attention_head_size, cfg.num_hashes, -1)  # (H, D, R, K)

    def check(self, ids: Tensor, mask: Tensor) -> dict[str, Any]:
        """One case: raises ExportError naming what failed; returns its record ("hashes": whether the
        decisions were compared and torch's buckets fed; the gaps that were gated)."""
        return self.check_outputs(ids, mask)[0]

    def check_outputs(self, ids: Tensor, mask: Tensor) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
        """`check`'s record, with torch's logits and the shipped graph's (B, L, vocab) beside it."""
        with torch.no_grad(), capture_hashes(self.model) as hashes:
            ref = self.model(ids, mask)
        logits, hidden = run_ort(self.shipped, ids, mask)  # refuses a mask with a hole, as torch does
        ref_logits, ref_hidden = ref.logits.numpy(), ref.hidden_states.numpy()
        return self._judge(ids, mask, hashes, ref_logits, ref_hidden, logits, hidden), ref_logits, logits

    def _judge(self, ids: Tensor, mask: Tensor, hashes: list[TorchHash], ref_logits: np.ndarray,
               ref_hidden: np.ndarray, logits: np.ndarray, hidden: np.ndarray) -> dict[str, Any]:
        real = mask.bool().numpy()
        length = int(ids.shape[1])
        if not hashes or any(h.buckets is None for h in hashes):
            gaps = {"logits": _worst(logits, ref_logits, real), "hidden_states": _worst(hidden, ref_hidden, real)}
            for name, gap in gaps.items():
                if not gap <= PARITY_TOLERANCE:  # also catches NaN
                    raise ExportError(f"{self.path.name}: onnxruntime {name} differ from torch by {gap:.3g} "
                                      f"(> {PARITY_TOLERANCE}) at {length} tokens; refusing to write the artifact")
            return {"hashes": False, **gaps}
        assert self.fed is not None
        counts = mask.sum(dim=1)
        padded = prepared_length(self.model, length)
        theirs = [static_layout(h.buckets, counts, padded, self.pad_bucket) for h in hashes if h.buckets is not None]
        feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                 **{FED_INPUT.format(i): t for i, t in enumerate(theirs)}}
        fed_logits, fed_hidden, *own = self.fed.run(OUTPUT_NAMES + self.hash_outputs, feeds)
        flips, decisions = self._decisions(hashes, theirs, own, counts, length)
        gaps = {}
        for name, out, want in (("logits", fed_logits, ref_logits), ("hidden_states", fed_hidden, ref_hidden)):
            # float error of a position's output scales with the size of its vector, so the relative part is
            # taken of the largest |torch| value at that position (a logit near 0 in a row of logits near 20
            # carries the row's rounding: 1.1e-4 at 4,096 tokens of the default artifact, with no flip)
            scale = np.abs(want).max(axis=-1, keepdims=True)  # (B, L, 1)
            excess = np.abs(out - want) - (FED_ATOL + FED_RTOL * scale)
            gaps[name] = _worst(out, want, real)
            if not (excess[real] <= 0).all():  # also catches NaN
                raise ExportError(
                    f"{self.path.name}: onnxruntime {name} differ from torch by {gaps[name]:.3g} at {length} tokens "
                    f"with torch's LSH buckets fed to the graph (allowed {FED_ATOL} + {FED_RTOL} x the position's "
                    "largest |torch| value): not a hash near-tie; refusing to write the artifact")
        return {"hashes": True, **gaps, "decisions": decisions, "flips": flips,
                "whole_input": whole_input_parity(ids, mask, ref_logits, ref_hidden, logits, hidden)}

    def _decisions(self, hashes: list[TorchHash], theirs: list[np.ndarray], own: list[np.ndarray], counts: Tensor,
                   length: int) -> tuple[list[dict[str, Any]], int]:
        """Compare every real decision; raise on the first flip that is no near-tie; return the flips and the
        number of decisions compared."""
        flips: list[dict[str, Any]] = []
        decisions = 0
        for record, torch_b, onnx_b in zip(hashes, theirs, own):
            if onnx_b.shape != torch_b.shape:
                raise ExportError(f"{self.path.name}: LSH buckets of layer {record.layer} are "
                                  f"{onnx_b.shape} in the graph, {torch_b.shape} from torch")
            real = (np.arange(onnx_b.shape[-1])[None, :] < counts.numpy()[:, None])[:, None, None, :]
            decisions += int(real.sum()) * onnx_b.shape[1] * onnx_b.shape[2]
            where = np.argwhere((onnx_b != torch_b) & real)  # (N, 4): row, head, round, position
            for start in range(0, len(where), MARGIN_BLOCK):
                block = where[start : start + MARGIN_BLOCK]
                ours = onnx_b[tuple(block.T)]
                their = torch_b[tuple(block.T)]
                margins = decision_margins(record.qk, self.rotations, self.factors, block, ours, their)
                for (row, head, rnd, pos), m, o, t in zip(block.tolist(), margins.tolist(), ours.tolist(),
                                                          their.tolist()):
                    flip = {"layer": record.layer, "round": rnd, "head": head, "row": row, "position": pos,
                            "margin": m, "torch_bucket": t, "onnx_bucket": o}
                    if not m <= TIE_MARGIN:
                        raise ExportError(
                            f"{self.path.name}: at {length} tokens onnxruntime hashes layer {record.layer} round "
                            f"{rnd} head {head} row {row} position {pos} to bucket {o}, torch to {t}, and "
                            f"torch's two best rotated values differ by {m:.3g} relative (> {TIE_MARGIN}): not a "
                            f"hash near-tie ({len(where)} decisions differ in that layer); refusing to write "
                            "the artifact")
                    flips.append(flip)
        return flips, decisions
