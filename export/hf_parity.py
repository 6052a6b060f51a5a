"""The parity gate of `reformer import-hf`: our model against transformers' on the same random inputs, with
both models given the same LSH buckets.

Why the buckets are shared: a position whose two best rotated scores lie within float rounding of each
other (a hash near-tie) can land in different buckets in two correct implementations, and one flipped
bucket in an early LSH layer moves that position's chunk window and, through it, the logits of every later
position that attends to it (google/reformer-enwik8's configuration with random weights: 0.0057 at 773
tokens from one flip, against 2.4e-6 on inputs without one). So transformers' `_hash_vectors` is wrapped,
per LSH layer, to return the buckets our model chose for that layer's input, and everything else
(embeddings, attention inside the chunks, feed-forward, head) is held to HF_PARITY_TOLERANCE. The hashing
itself is still checked: every bucket transformers would have chosen is compared with ours, and each
disagreement must be a near-tie, that is, our bucket's rotated score (transformers' rotations, transformers'
vector) within TIE_TOLERANCE (relative) of the best one. A wrong rotation, seed or projection disagrees on
most positions by whole score gaps and is refused, naming the layer.

A refusal names what differs: the first layer whose outputs differ (a second pass with both models'
layer outputs taken), the configuration fields our model reads differently from transformers', and the
weights that differ from the checkpoint's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from model import ReformerConfig, ReformerLM
from model.attention import LSHSelfAttention
from model.hf import hf_state_dict_to_ours
from model.lsh.hashing import bucket_factors, hash_rotations

from .hf_errors import HFImportError

HF_PARITY_TOLERANCE = 1e-4
# relative gap between transformers' best rotated score and our bucket's: float32 rounding between the two
# implementations is ~1e-6 relative; a wrong hash loses by a sizeable share of the score
TIE_TOLERANCE = 1e-4
# configuration fields that change the eval forward (dropouts, initialisers and the hash seed, which the gate
# sets on both sides, do not)
FORWARD_FIELDS = (
    "attention_head_size", "attn_layers", "axial_pos_embds", "axial_pos_shape", "axial_pos_embds_dim",
    "feed_forward_size", "hidden_act", "hidden_size", "layer_norm_eps", "local_attn_chunk_length",
    "local_num_chunks_before", "local_num_chunks_after", "lsh_attn_chunk_length", "lsh_num_chunks_before",
    "lsh_num_chunks_after", "max_position_embeddings", "num_attention_heads", "num_buckets", "num_hashes",
    "vocab_size",
)
MAX_RECORDED_TIES = 5


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def config_differences(ours: ReformerConfig, hf_config: Any) -> list[str]:
    """'field ours (ours) vs theirs (transformers)' for every forward-relevant field read differently."""
    out = []
    for name in FORWARD_FIELDS:
        mine, theirs = _plain(getattr(ours, name)), _plain(getattr(hf_config, name, None))
        if mine != theirs:
            out.append(f"{name} {mine} (ours) vs {theirs} (transformers)")
    return out


def weight_differences(model: ReformerLM, hf_model: Any) -> list[str]:
    """Our tensors that are not exactly the checkpoint's (as transformers loaded it), by our name."""
    theirs = hf_state_dict_to_ours(hf_model.state_dict())
    out = []
    for name, tensor in model.state_dict().items():
        ref = theirs.get(name)
        if ref is None:
            out.append(f"{name} (not in the checkpoint)")
        elif ref.shape != tensor.shape:
            out.append(f"{name} shape {tuple(tensor.shape)} vs {tuple(ref.shape)}")
        elif not torch.equal(ref, tensor):
            out.append(f"{name} (max abs diff {float((ref.float() - tensor.float()).abs().max()):.3g})")
    return out


@dataclass
class BucketStats:
    """What the hashing comparison saw over all inputs."""

    choices: int = 0  # bucket choices compared (positions x heads x rounds x LSH layers x inputs)
    disagreements: int = 0
    largest_relative_gap: float = 0.0
    ties: list[dict[str, Any]] = field(default_factory=list)  # the first MAX_RECORDED_TIES disagreements

    def record(self) -> dict[str, Any]:
        return {"forced_equal": True, "choices_compared": self.choices, "disagreements": self.disagreements,
                "largest_relative_gap": self.largest_relative_gap, "tie_tolerance": TIE_TOLERANCE,
                "examples": self.ties}


def lsh_layers(layers: Any, lsh_class: type) -> list[tuple[int, Any]]:
    """(index, attention module) of the LSH layers in ours' or transformers' layer list (the same attribute
    path in both)."""
    return [(i, layer.attention.self_attention) for i, layer in enumerate(layers)
            if isinstance(layer.attention.self_attention, lsh_class)]


@contextmanager
def our_buckets(model: ReformerLM) -> Iterator[list[tuple[int, Tensor]]]:
    """Collects (layer index, buckets (B, H, R, L')) from our LSH layers that hash during the forward."""
    taken: list[tuple[int, Tensor]] = []

    def hook(index: int) -> Callable[..., None]:
        def take(module: nn.Module, args: Any, output: tuple[Tensor, Tensor | None]) -> None:
            if output[1] is not None:  # None: the input fits one chunk and is attended densely
                taken.append((index, output[1]))
        return take

    handles = [att.register_forward_hook(hook(i)) for i, att in lsh_layers(model.layers, LSHSelfAttention)]
    try:
        yield taken
    finally:
        for h in handles:
            h.remove()


def reset_num_buckets(hf_model: Any) -> None:
    """transformers sets an unset num_buckets from the first input's length and keeps it for later ones;
    each input gets its own, as ours does."""
    from transformers.models.reformer.modeling_reformer import LSHSelfAttention as HFLSH

    for _, att in lsh_layers(hf_model.reformer.encoder.layers, HFLSH):
        att.num_buckets = hf_model.config.num_buckets


def _factors(num_buckets: int | list[int] | tuple[int, ...]) -> list[int]:
    return bucket_factors(num_buckets if isinstance(num_buckets, int) else list(num_buckets))


def _their_rotations(att: Any, vectors: Tensor, rounds: int, size: int) -> Tensor:
    """The rotations transformers' _hash_vectors draws after `torch.manual_seed(hash_seed)` for a float32
    model: model/lsh/hashing.py draws the same numbers from a private generator."""
    return hash_rotations(att.hash_seed, att.num_attention_heads, vectors.shape[-1], rounds, size).to(vectors.dtype)


def _tie_gaps(att: Any, vectors: Tensor, ours: Tensor, theirs: Tensor, where: Tensor) -> Tensor:
    """Relative gap, at each disagreeing (b, h, r, l) in `where` (K, 4), between transformers' best rotated
    score and the score of the bucket we chose, worst over the bucket factors that differ; inf where one
    side put a real position in the padding bucket."""
    factors = _factors(att.num_buckets)
    scale = math.prod(factors)
    rot = _their_rotations(att, vectors, ours.shape[2], sum(factors))  # (H, D, R, rot/2)
    b, h, r, pos = where.unbind(1)
    rotated = torch.einsum("kd,kdn->kn", vectors[b, h, pos], rot[h, :, r])  # (K, rot/2)
    gaps = torch.zeros(where.shape[0], dtype=torch.float64)
    mine, other = ours[b, h, r, pos], theirs[b, h, r, pos]
    start, stride = 0, 1
    for f in factors:
        scores = torch.cat([rotated[:, start : start + f // 2], -rotated[:, start : start + f // 2]], dim=1)
        digit, their_digit = (mine // stride) % f, (other // stride) % f
        top = scores.max(dim=1).values
        gap = (top - scores.gather(1, digit.clamp(max=f - 1)[:, None]).squeeze(1)).double()
        rel = gap / top.abs().double().clamp_min(1e-30)
        gaps = torch.where(digit != their_digit, torch.maximum(gaps, rel), gaps)
        start, stride = start + f // 2, stride * f
    return torch.where((mine >= scale) | (other >= scale), torch.full_like(gaps, math.inf), gaps)


@contextmanager
def forced_buckets(hf_model: Any, ours: list[tuple[int, Tensor]], stats: BucketStats, length: int,
                   where: str, strict: bool = True) -> Iterator[None]:
    """transformers' LSH layers hash as usual (so their choice is compared with ours) and then use ours.
    Raises HFImportError naming the layer when a disagreement is no near-tie (unless not `strict`: the
    localising pass, which only needs our buckets used)."""
    from transformers.models.reformer.modeling_reformer import LSHSelfAttention as HFLSH

    queue = list(ours)
    patched = lsh_layers(hf_model.reformer.encoder.layers, HFLSH)

    def wrapped(index: int, att: Any, original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def hash_vectors(vectors: Tensor, num_hashes: int, attention_mask: Tensor | None,
                         increase_num_buckets: bool = False) -> Tensor:
            flat = original(vectors, num_hashes, attention_mask, increase_num_buckets)  # (B, H, R*L), offset
            if not queue or queue[0][0] != index:
                raise HFImportError(f"{where}: at {length} tokens transformers hashes in layer {index} but our "
                                    "model does not (the layers differ in kind or in when they hash)")
            _, mine = queue.pop(0)
            bsz, heads, seq, _ = vectors.shape  # (B, H, L, D)
            if tuple(mine.shape) != (bsz, heads, num_hashes, seq):
                raise HFImportError(f"{where}: at {length} tokens layer {index} (lsh) hashes {tuple(mine.shape)} "
                                    f"(batch, heads, rounds, length) in our model, {(bsz, heads, num_hashes, seq)} "
                                    "in transformers")
            # undo transformers' per-round offsets: rounds are numbered in blocks of its bucket count, plus
            # one when a padding bucket was added (the same rule as in _hash_vectors)
            count = math.prod(_factors(att.num_buckets))
            padded = attention_mask is not None and int(attention_mask.sum()) < attention_mask.numel()
            count += int(padded or increase_num_buckets)
            offsets = (torch.arange(num_hashes) * count).view(1, 1, -1, 1)
            theirs = flat.view(bsz, heads, num_hashes, seq) - offsets
            differ = (theirs != mine).nonzero()  # (K, 4): b, h, r, l
            stats.choices += mine.numel()
            if differ.numel():
                gaps = _tie_gaps(att, vectors.detach().float(), mine, theirs, differ)
                stats.disagreements += differ.shape[0]
                worst = int(gaps.argmax())
                stats.largest_relative_gap = max(stats.largest_relative_gap, float(gaps[worst]))
                bb, hh, rr, pp = (int(v) for v in differ[worst])
                if strict and not float(gaps[worst]) <= TIE_TOLERANCE:
                    raise HFImportError(
                        f"{where}: at {length} tokens layer {index} (lsh) puts {differ.shape[0]} of {mine.numel()} "
                        f"hash choices in other buckets than transformers, and not by a near-tie: at row {bb}, "
                        f"position {pp} (head {hh}, round {rr}) transformers' best rotated score beats our "
                        f"bucket's by {float(gaps[worst]):.3g} of itself (> {TIE_TOLERANCE})")
                for k in range(min(differ.shape[0], MAX_RECORDED_TIES - len(stats.ties))):
                    bb, hh, rr, pp = (int(v) for v in differ[k])
                    stats.ties.append({"length": length, "layer": index, "row": bb, "position": pp, "head": hh,
                                       "round": rr, "relative_gap": float(gaps[k])})
            return (mine + offsets).flatten(start_dim=2)

        return hash_vectors

    try:
        for index, att in patched:
            att._hash_vectors = wrapped(index, att, att._hash_vectors)  # instance attribute: this model only
        yield
    finally:
        for _, att in patched:
            att.__dict__.pop("_hash_vectors", None)
    if queue:
        raise HFImportError(f"{where}: at {length} tokens our model hashes in layer {queue[0][0]} but transformers "
                            "does not (the layers differ in kind or in when they hash)")


@contextmanager
def _layer_outputs(modules: list[nn.Module], pick: Callable[[Any], list[Tensor]]
                   ) -> Iterator[list[list[Tensor]]]:
    taken: list[list[Tensor]] = []

    def take(module: nn.Module, args: Any, output: Any) -> None:
        taken.append([t.detach() for t in pick(output)])

    handles = [m.register_forward_hook(take) for m in modules]
    try:
        yield taken
    finally:
        for h in handles:
            h.remove()


def first_difference(model: ReformerLM, hf_model: Any, ids: Tensor, where: str) -> str:
    """Which module's output first differs by more than the tolerance, both models given our buckets."""
    n = ids.shape[1]
    names = ["the embeddings"]
    for i, kind in enumerate(model.config.attn_layers):
        names += [f"layer {i} ({kind}) attention", f"layer {i} ({kind}) feed-forward"]
    ours_mods: list[nn.Module] = [model.embeddings, *model.layers]
    hf_mods: list[nn.Module] = [hf_model.reformer.embeddings, *hf_model.reformer.encoder.layers]
    with torch.no_grad(), _layer_outputs(ours_mods, lambda o: [o] if isinstance(o, Tensor) else [o[0], o[1]]) as a:
        with our_buckets(model) as buckets:
            model(ids)
        reset_num_buckets(hf_model)
        with _layer_outputs(hf_mods, lambda o: [o] if isinstance(o, Tensor) else [o.attn_output, o.hidden_states]
                            ) as b, forced_buckets(hf_model, buckets, BucketStats(), n, where, strict=False):
            hf_model(ids, use_cache=False)
    mine = [t for out in a for t in out]
    theirs = [t for out in b for t in out]
    for name, x, y in zip(names, mine, theirs):
        if x.shape[-1] != y.shape[-1]:
            return f"{name}: width {x.shape[-1]} (ours) vs {y.shape[-1]} (transformers)"
        gap = float((x[:, :n] - y[:, :n]).abs().max())
        if not gap <= HF_PARITY_TOLERANCE:
            return f"{name}, by {gap:.3g}"
    return "none in the embeddings or layer outputs"


def differences(model: ReformerLM, hf_model: Any) -> list[str]:
    """The configuration fields and weights our model holds differently from transformers'."""
    parts = []
    configs = config_differences(model.config, hf_model.config)
    if configs:
        parts.append("configuration read differently: " + "; ".join(configs))
    weights = weight_differences(model, hf_model)
    if weights:
        parts.append(f"weights that differ from the checkpoint's ({len(weights)}): " + "; ".join(weights[:3]))
    return parts


def compare(model: ReformerLM, hf_model: Any, ids: Tensor, stats: BucketStats, where: str,
            force: bool = True) -> float:
    """Largest logit difference on `ids`. With `force`, transformers uses our buckets (checked to be ties
    where they differ from its own), and a difference over the tolerance or a bucket that is no tie raises
    HFImportError naming where the models part and what they hold differently. Without, the plain
    comparison that a near-tie can fail: nothing is raised."""
    n = ids.shape[1]
    with torch.no_grad():
        if not force:
            return float((hf_model(ids, use_cache=False).logits - model(ids).logits).abs().max())
        with our_buckets(model) as buckets:
            got = model(ids).logits
        try:
            with forced_buckets(hf_model, buckets, stats, n, where):
                ref = hf_model(ids, use_cache=False).logits
        except HFImportError as e:
            # a bucket that is no tie can be the hash's fault or come from an earlier layer's difference
            raise HFImportError(". ".join([
                str(e), f"first difference with both models given our buckets: "
                f"{first_difference(model, hf_model, ids, where)}", *differences(model, hf_model)])) from None
    gap = float((ref - got).abs().max())
    if not gap <= HF_PARITY_TOLERANCE:  # also NaN
        raise HFImportError(". ".join([
            f"{where}: our logits differ from transformers' by {gap:.3g} at {n} tokens with both models given "
            f"the same LSH buckets (> {HF_PARITY_TOLERANCE})",
            f"first difference: {first_difference(model, hf_model, ids, where)}",
            *differences(model, hf_model)]))
    return gap
