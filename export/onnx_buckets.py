"""The LSH bucket tensors of an exported graph, found by the graph's structure, and the graph the tie-aware
export check runs (export/onnx_ties.py): the same graph with each layer's sort reading its buckets from an
input, so that torch's buckets can be fed in, and each layer's own hash result as an extra output.

A bucket tensor is found from the sort it feeds, not from a generated name (names change with every
exporter version): `bucket_order` sorts `buckets * length + position`, which exports as a TopK over an Add
of a Mul; the Mul's operand that traces back, through no matrix product, to an ArgMax over a MatMul with a
constant (the rotations: `hash_buckets`) is the (B, H, R, L') int64 bucket tensor, padding in the extra
bucket, in the graph's prepared (right-padded, chunk-padded) layout. The graph's nodes are in topological
order and every LSH layer's hash depends on the layer before, so the tensors are found in layer order; that
order is checked (each one depends on the one before) and exactly one per LSH layer is required."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import onnx
from onnx import TensorProto, helper

from .onnx_run import ExportError

SORT_OP = "TopK"
HASH_OPS = {"ArgMax", "ArgMin"}  # the argmax over [x, -x] runs as max(x) against -min(x)
FED_INPUT = "lsh_buckets_{}"  # the fed graph's inputs, one per LSH layer in layer order
HASH_OUTPUT = "lsh_hash_{}"  # its outputs: what each layer's own hash computed
BUCKET_DIMS = ["batch", "heads", "rounds", "padded"]


@dataclass(frozen=True)
class BucketSite:
    tensor: str  # the bucket tensor's name in the graph
    product: str  # the output of the hash's MatMul (the rotated query-keys)
    rotations: str  # that MatMul's constant operand (H, D, R*K): the rotations


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output}


def _constants(graph: onnx.GraphProto) -> set[str]:
    """Tensors computed from initializers alone (the optimizer leaves a large constant's Reshape unfolded)."""
    names = {i.name for i in graph.initializer}
    for node in graph.node:  # topological order: a node's inputs are decided before it
        if all(not i or i in names for i in node.input) and (node.input or node.op_type == "Constant"):
            names.update(node.output)
    return names


def _walk_up(start: str, producers: dict[str, onnx.NodeProto], stop: set[str]) -> list[onnx.NodeProto]:
    """Every node `start` depends on, not going past nodes whose op is in `stop` (they are listed, their
    inputs not followed)."""
    seen: set[str] = set()
    found: list[onnx.NodeProto] = []
    todo = [start]
    while todo:
        name = todo.pop()
        node = producers.get(name)
        if node is None or node.output[0] in seen:  # outputs are unique; node names need not be
            continue
        seen.add(node.output[0])
        found.append(node)
        if node.op_type not in stop:
            todo.extend(node.input)
    return found


def _hash_product(tensor: str, producers: dict[str, onnx.NodeProto], constants: set[str]
                  ) -> tuple[str, str] | None:
    """(output, constant operand) of the one MatMul with a constant behind the ArgMax that `tensor` is made
    of, or None when `tensor` is not an argmax of such a product."""
    hashes = [n for n in _walk_up(tensor, producers, {"MatMul"} | HASH_OPS) if n.op_type in HASH_OPS]
    products = set()
    for node in hashes:
        for product in _walk_up(node.input[0], producers, {"MatMul"}):
            if product.op_type == "MatMul":
                products |= {(product.output[0], i) for i in product.input if i in constants}
    return products.pop() if len(products) == 1 else None


def find_bucket_sites(model: onnx.ModelProto, lsh_layers: int) -> list[BucketSite]:
    """The bucket tensor of each LSH layer, in layer order. Raises ExportError unless exactly one is found
    per layer and each depends on the one before."""
    graph = model.graph
    producers = _producers(graph)
    constants = _constants(graph)
    sites: list[BucketSite] = []
    for node in graph.node:
        if node.op_type != SORT_OP:
            continue
        key = producers.get(node.input[0])
        if key is None or key.op_type != "Add":
            continue
        found = []
        for part in key.input:
            mul = producers.get(part)
            if mul is None or mul.op_type != "Mul":
                continue
            for operand in mul.input:
                product = _hash_product(operand, producers, constants)
                if product is not None:
                    found.append(BucketSite(operand, *product))
        if len(found) > 1:
            raise ExportError(f"a sort in the graph reads {len(found)} hashed tensors; expected one")
        sites += found
    if len(sites) != lsh_layers:
        raise ExportError(f"found {len(sites)} LSH bucket tensors in the graph; the model has {lsh_layers} LSH "
                          "layers (one bucket tensor each)")
    for earlier, later in zip(sites, sites[1:]):
        if earlier.tensor not in {o for n in _walk_up(later.tensor, producers, set()) for o in n.output}:
            raise ExportError(f"bucket tensor {later.tensor} does not depend on {earlier.tensor}: the found "
                              "tensors are not one per layer in layer order")
    return sites


def _int64_value(name: str, dims: Iterable[str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.INT64, list(dims))


def with_buckets_fed(model: onnx.ModelProto, sites: list[BucketSite]) -> onnx.ModelProto:
    """The graph with every LSH layer's sort reading its buckets from an input (FED_INPUT, layer order) in
    place of its own hash, and each hash's own result kept as an extra output (HASH_OUTPUT, after logits and
    hidden_states). Fed torch's buckets, every layer's hash then sees what torch's did up to rounding: a
    flip in one layer does not move the next layer's hash input."""
    out = copy.deepcopy(model)
    graph = out.graph
    renames = {site.tensor: FED_INPUT.format(i) for i, site in enumerate(sites)}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    for i, site in enumerate(sites):
        graph.input.append(_int64_value(FED_INPUT.format(i), BUCKET_DIMS))
        name = HASH_OUTPUT.format(i)
        graph.node.append(helper.make_node("Identity", [site.tensor], [name], name=name))
        graph.output.append(_int64_value(name, BUCKET_DIMS))
    return out


def session_for(model: onnx.ModelProto, threads: int = 0) -> Any:
    """An onnxruntime CPU session of an in-memory graph."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
