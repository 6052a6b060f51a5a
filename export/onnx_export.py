"""ONNX export of the eval forward, with dynamic batch and sequence length, and its verification against
torch on fresh random inputs.

The eager model picks code paths in Python from shapes and data (dense attention for sequences that fit
one chunk, fast paths for unpadded batches, feed-forward chunking by length), which a traced graph cannot
keep. `OnnxForward` traces the model's static-shape forward (export/onnx_graph.py `static_forward`),
the one path valid for every shape, with the model's batch preparation inside the graph: the mask may pad
rows on the left, the right or both. A graph cannot raise, so a mask with a hole (a 0 between real tokens)
is refused before the graph runs (`run_ort`, and the service's onnxruntime backend) with the ValueError
torch raises. Verification compares every real token of every row with the eager model, logits and
hidden states, at lengths below, at and above one chunk, at 4,096 tokens and in left-, right- and
both-side-padded batches, and refuses a graph that differs by more than PARITY_TOLERANCE.

Inputs that LSH-hash cannot always be held to that: an LSH bucket is an argmax over rotated projections,
and where a position's two best projections lie within ~1e-7 (relative) of each other, onnxruntime's
rounding can pick the other bucket, which moves many logits. A case that hashes is therefore checked by
export/onnx_ties.py: every hash decision of the graph against torch's (a differing one is accepted only as
a near-tie, and recorded), and the graph's output with torch's buckets fed in held to 1e-4 plus 1e-5 of the
position's largest |torch| value on every real token. Its whole-input figures (`whole_input_parity`) are
recorded, not gated. Cases that do not hash (no row longer than one LSH chunk, or no LSH layer) are held to
PARITY_TOLERANCE.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from model import ReformerLM

from . import onnx_ties as ties
from .onnx_graph import static_forward
from .onnx_run import INPUT_NAMES, OUTPUT_NAMES, PARITY_TOLERANCE, ExportError, ort_session, run_ort, whole_input_parity

# the run and comparison helpers live in onnx_run.py (the tie-aware check needs them too); callers of this
# module keep finding them here
__all__ = ["INPUT_NAMES", "OUTPUT_NAMES", "PARITY_TOLERANCE", "ExportError", "OnnxForward", "check_graph",
           "export_and_verify", "export_onnx", "max_export_length", "ort_session", "run_ort", "verification_cases",
           "verify_onnx", "whole_input_parity"]

OPSET = 20
RANDOM_OPS = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}

log = logging.getLogger(__name__)


class OnnxForward(nn.Module):
    """(input_ids, attention_mask) int64 (B, L), each row's real tokens one contiguous run -> (logits
    (B, L, vocab), hidden_states (B, L, 2*hidden)), for every row as eager computes that row alone."""

    def __init__(self, model: ReformerLM) -> None:
        super().__init__()
        check_exportable(model)
        self.model = model
        self.multiple = math.lcm(*model.config.chunk_lengths())

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        return static_forward(self.model, input_ids, attention_mask)


def check_exportable(model: ReformerLM) -> None:
    cfg = model.config
    if cfg.num_buckets is None:
        raise ExportError(
            "ONNX export needs a fixed num_buckets in the config: with num_buckets=None the bucket count (and "
            "so the hash rotations) depends on the sequence length, which a graph with a dynamic length "
            "cannot hold as constants. Set num_buckets (e.g. 2*max_length/lsh_attn_chunk_length rounded to "
            "a power of two) before training, or serve this model with the torch backend.")


def max_export_length(model: ReformerLM) -> int:
    """The longest input the graph accepts: its padded length must fit the position embeddings."""
    multiple = math.lcm(*model.config.chunk_lengths())
    return model.config.max_position_embeddings // multiple * multiple


def export_onnx(model: ReformerLM, path: Path, optimize: bool = True) -> dict[str, Any]:
    """Write the graph (weights embedded, one file) to `path`; returns check_graph's findings.
    `optimize=False` skips onnxscript's graph optimizer: the larger but equivalent graph runs as fast in
    onnxruntime, which optimizes at session start (12 layers at hidden 64: 1.9-2.3 s against 2.3 s for
    2 x 1,031 tokens), and skips what took 188 s of a profiled 437 s export (export/onnx_budget.py)."""
    model.config.refuse_key_conv("ONNX export")
    model = model.eval()
    wrapper = OnnxForward(model).eval()
    multiple = wrapper.multiple
    # example: two rows, a length that is no chunk multiple and spans several chunks
    t = min(3 * multiple + 3, max_export_length(model))
    ids = torch.randint(2, model.config.vocab_size, (2, t))
    mask = torch.ones_like(ids)
    mask[1, t // 2 :] = 0
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    seq = torch.export.Dim("sequence", min=1, max=max_export_length(model))
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    start = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            wrapper, (ids, mask), dynamo=True, opset_version=OPSET, input_names=INPUT_NAMES,
            output_names=OUTPUT_NAMES, dynamic_shapes=dynamic, optimize=optimize, verbose=False)
    assert program is not None
    traced = time.perf_counter()
    program.save(str(path), external_data=False)
    saved = time.perf_counter()
    info = check_graph(path)
    # where a large model's export time goes (bench/import_hf/import_hf_enwik8.py keeps the import's log tail)
    log.info("ONNX graph of %d nodes: torch.onnx.export %.1f s, save %.1f s, check %.1f s", info["nodes"],
             traced - start, saved - traced, time.perf_counter() - saved)
    return info


def check_graph(path: Path) -> dict[str, Any]:
    """Structural checks: opset, input/output names and dynamic axes, no random operators."""
    import onnx

    onnx.checker.check_model(str(path))  # from the file: no second serialised copy of a large graph
    graph_model = onnx.load(str(path))
    ops: set[str] = set()

    def visit(nodes: Any) -> None:
        for node in nodes:
            ops.add(node.op_type)
            for attr in node.attribute:
                if attr.g is not None:
                    visit(attr.g.node)
                for g in attr.graphs:
                    visit(g.node)

    visit(graph_model.graph.node)
    for fn in graph_model.functions:
        visit(fn.node)
    random_ops = sorted(ops & RANDOM_OPS)
    if random_ops:
        raise ExportError(f"{path.name}: graph contains random operators {random_ops}")
    opset = max(o.version for o in graph_model.opset_import if o.domain in ("", "ai.onnx"))
    if opset < 17:
        raise ExportError(f"{path.name}: opset {opset} < 17")
    names_in = [i.name for i in graph_model.graph.input]
    names_out = [o.name for o in graph_model.graph.output]
    if names_in != INPUT_NAMES or names_out != OUTPUT_NAMES:
        raise ExportError(f"{path.name}: graph inputs {names_in} / outputs {names_out}, expected "
                          f"{INPUT_NAMES} / {OUTPUT_NAMES}")
    for value in list(graph_model.graph.input) + list(graph_model.graph.output):
        dims = value.type.tensor_type.shape.dim[:2]
        if any(d.HasField("dim_value") for d in dims):
            raise ExportError(f"{path.name}: {value.name} has a fixed batch or sequence dimension")
    return {"opset": opset, "ops": sorted(ops), "nodes": len(graph_model.graph.node)}


LONG_LENGTH = 4096  # always verified (capped at the graph's maximum)
LONGER_LENGTH = 16384  # verified with long=True


def padded_batch(rows: list[tuple[int, int, int]], vocab: int, pad_id: int, g: torch.Generator
                 ) -> tuple[Tensor, Tensor]:
    """rows of (left padding, real tokens, right padding), all of one total length -> ids, mask (B, L)."""
    t = sum(rows[0])
    ids = torch.randint(2, vocab, (len(rows), t), generator=g)
    mask = torch.zeros_like(ids)
    for i, (left, n, right) in enumerate(rows):
        assert left + n + right == t
        mask[i, left : left + n] = 1
    return ids.masked_fill(mask == 0, pad_id), mask


def verification_cases(model: ReformerLM, seed: int = 0, long: bool = False) -> list[tuple[Tensor, Tensor]]:
    """Fresh random inputs: single rows of lengths around the chunk length (shorter than one chunk, exact
    multiples, not multiples, several chunks) and of 4,096 tokens (and 16,384 with `long`), and batches of
    mixed lengths padded on the right, on the left and on both sides."""
    cfg = model.config
    m = math.lcm(*cfg.chunk_lengths())
    top = max_export_length(model)
    g = torch.Generator().manual_seed(seed)
    longest = [LONG_LENGTH, LONGER_LENGTH] if long else [LONG_LENGTH]
    lengths = sorted({min(n, top) for n in (1, max(2, m // 2 + 1), m, m + 3, 3 * m - 1, 6 * m + 5, *longest)})
    cases = []
    for n in lengths:
        ids = torch.randint(2, cfg.vocab_size, (1, n), generator=g)
        cases.append((ids, torch.ones_like(ids)))
    a, b, c = min(4 * m + 7, top), min(m + 1, top), max(1, m // 2)
    d, e = min(2 * m, top), min(2 * m - 3, top)
    batches = [
        [(0, a, 0), (0, b, a - b), (0, c, a - c)],  # right padding
        [(0, d, 0), (0, e, d - e)],
        [(0, a, 0), (a - b, b, 0), (a - c, c, 0)],  # left padding
        [(0, a, 0), (3, b, a - b - 3), ((a - c) // 2, c, a - c - (a - c) // 2)],  # both sides
    ]
    for rows in batches:
        if all(left >= 0 and right >= 0 for left, _, right in rows):
            cases.append(padded_batch(rows, cfg.vocab_size, cfg.pad_token_id, g))
    return cases


def verify_onnx(model: ReformerLM, path: Path, seed: int = 0, long: bool = False,
                cases: list[tuple[Tensor, Tensor]] | None = None) -> dict[str, Any]:
    """Torch (the eager model) against onnxruntime over the verification cases (module docstring): a case that
    does not hash held to PARITY_TOLERANCE on every real token, logits and hidden states (what the
    onnxruntime backend pools into embeddings: `max_abs_diff_*`); a case that hashes checked decision by
    decision and with torch's buckets fed (export/onnx_ties.py: `fed_max_abs_diff_*`), its near-tie flips and
    whole-input figures recorded in `hashing_cases`. Raises ExportError naming the first failure. `cases`
    replaces verification_cases (a large model's affordable subset: export/onnx_budget.py)."""
    check = ties.TieCheck(model, path)
    # the largest differences of the cases that do not hash (held to PARITY_TOLERANCE) and, apart, of those
    # that do with torch's buckets fed (held to the tie check's own tolerance)
    worst = {False: {"logits": 0.0, "hidden_states": 0.0}, True: {"logits": 0.0, "hidden_states": 0.0}}
    shapes, hashing = [], []
    for ids, mask in cases if cases is not None else verification_cases(model, seed, long):
        record = check.check(ids, mask)
        shapes.append([int(v) for v in mask.sum(dim=1)])
        for name, value in worst[record["hashes"]].items():
            worst[record["hashes"]][name] = max(value, record[name])
        if record["hashes"]:
            hashing.append({"length": int(ids.shape[1]), "rows": shapes[-1], "decisions": record["decisions"],
                            "near_tie_flips": record["flips"], "fed_max_abs_diff_logits": record["logits"],
                            "fed_max_abs_diff_hidden_states": record["hidden_states"],
                            "whole_input": record["whole_input"]})
    return {"max_abs_diff_logits": worst[False]["logits"], "max_abs_diff_hidden_states": worst[False]["hidden_states"],
            "tolerance": PARITY_TOLERANCE, "fed_max_abs_diff_logits": worst[True]["logits"],
            "fed_max_abs_diff_hidden_states": worst[True]["hidden_states"],
            "fed_tolerance": {"absolute": ties.FED_ATOL, "relative_to_position_max": ties.FED_RTOL},
            "tie_margin": ties.TIE_MARGIN, "cases": shapes, "seed": seed, "hashing_cases": hashing,
            "near_tie_flips": sum(len(c["near_tie_flips"]) for c in hashing)}


def export_and_verify(model: ReformerLM, path: Path, cases: list[tuple[Tensor, Tensor]] | None = None,
                      optimize: bool = True) -> dict[str, Any]:
    """Export, check the graph's structure, verify parity (on `cases` when given); returns what the
    manifest records."""
    start = time.perf_counter()
    # export_onnx checked the graph: loading and checking it again took 19 s for enwik8's 611 MB graph
    info = export_onnx(model, path, optimize=optimize)
    exported = time.perf_counter()
    parity = verify_onnx(model, path, long=True, cases=cases)  # 16,384 tokens too, where the graph accepts them
    phases = {"export": round(exported - start, 2), "verify": round(time.perf_counter() - exported, 2)}
    log.info("exported %s: opset %d, max abs diff %.3g", path.name, info["opset"], parity["max_abs_diff_logits"])
    return {"file": path.name, "opset": info["opset"], "nodes": info["nodes"], "dynamic_axes": ["batch", "sequence"],
            "max_length": max_export_length(model), "random_ops": [], "parity": parity, "optimized": optimize,
            "max_abs_diff": parity["max_abs_diff_logits"], "export_seconds": round(time.perf_counter() - start, 2),
            "phase_seconds": phases}
