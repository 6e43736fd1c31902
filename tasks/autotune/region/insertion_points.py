"""Pattern-relative Q/DQ insertion points and their resolution on concrete regions.

A point names a place by its position in the pattern, not by tensor names, so one scheme applies to
every region of a pattern and transfers between models:

- ``node_input``   (node k, input slot s): Q/DQ on that input of that node only;
- ``node_output``  (node k): Q/DQ after the node's output "tail" (past a bias Add for MatMul and a
  Relu/Clip), read by every consumer: this is what makes ORT fuse DQ -> op -> Q into an integer kernel;
- ``child_input``  (child c, boundary input j): Q/DQ on a child region's input, for the consumers in it;
- ``region_output`` (j): Q/DQ on the region's j-th boundary output, for every consumer;
- ``activation_input`` (node k, input slot s): like ``node_input``, but a weighted op's weights stay
  float (subgraph mode's activations-only scheme);
- ``weight`` (node k): Q/DQ on a weighted op's weights only, its activations stay float (subgraph
  mode's weights-only scheme).

Which points are candidates depends on the backend (``candidate_points``): TensorRT fuses Q/DQ into
the inputs of weighted ops and residual Adds (node inputs), ORT CPU needs whole DQ -> op -> Q
groups (node inputs and node outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from pipeline.graph.index import GraphIndex, computes_on, weight_inputs
from pipeline.graph.model import WEIGHTED_OPS
from pipeline.quant.placement import PASS_THROUGH_OPS, PLACEMENTS, too_small
from tasks.autotune.region.region import Region

KINDS = ("node_input", "node_output", "child_input", "region_output", "activation_input", "weight")
_SHORT = {"node_input": "ni", "node_output": "no", "child_input": "ci", "region_output": "ro",
          "activation_input": "ai", "weight": "w"}
_LONG = {v: k for k, v in _SHORT.items()}

# ops that get a Q/DQ'd input in ORT's fused groups (besides weighted ops)
ORT_INPUT_OPS = ("Add", "Mul", "Concat", "AveragePool", "GlobalAveragePool", *PASS_THROUGH_OPS)
# ops whose output ORT can emit quantized (QLinear* kernels or 8-bit data movement)
ORT_OUTPUT_OPS = ("Conv", "Gemm", "MatMul", "Add", "Mul", "Concat", "AveragePool", "GlobalAveragePool",
                  *PASS_THROUGH_OPS)


@dataclass(frozen=True, order=True)
class InsertionPoint:
    kind: str
    index: int
    slot: int = 0

    @property
    def key(self) -> str:
        return f"{_SHORT[self.kind]}:{self.index}:{self.slot}"

    @classmethod
    def from_key(cls, key: str) -> InsertionPoint:
        kind, index, slot = key.split(":")
        return cls(_LONG[kind], int(index), int(slot))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "index": self.index, "slot": self.slot}

    @classmethod
    def from_dict(cls, d: dict) -> InsertionPoint:
        return cls(d["kind"], int(d["index"]), int(d.get("slot", 0)))


@dataclass(frozen=True)
class ResolvedPoint:
    """A point on a concrete region: the tensor, who reads the DQ copy (None = all), the node whose
    weights go with it (a weighted op's data input). ``tensor`` is None for a weights-only point."""

    tensor: str | None
    consumers: tuple[tuple[str, int], ...] | None
    weight_node: str | None = None


def resolve(point: InsertionPoint, region: Region, order: list[int], model: onnx.ModelProto,
            g: GraphIndex) -> ResolvedPoint | None:
    nodes = model.graph.node
    if point.kind in ("node_input", "activation_input"):
        if point.index >= len(order):
            return None
        node = nodes[order[point.index]]
        if point.slot >= len(node.input) or not g.is_activation(node.input[point.slot]):
            return None
        weight_node = node.name if (point.kind == "node_input" and node.op_type in WEIGHTED_OPS and point.slot == 0
                                    and weight_inputs(g, node)) else None
        return ResolvedPoint(node.input[point.slot], ((node.name, point.slot),), weight_node)
    if point.kind == "weight":
        if point.index >= len(order):
            return None
        node = nodes[order[point.index]]
        return ResolvedPoint(None, None, node.name) if node.op_type in WEIGHTED_OPS and weight_inputs(g, node) \
            else None
    if point.kind == "node_output":
        if point.index >= len(order):
            return None
        node = nodes[order[point.index]]
        if not node.output or not g.is_activation(node.output[0]):
            return None
        return ResolvedPoint(g.tail(node), None)
    if point.kind == "child_input":
        if point.index >= len(region.children):
            return None
        child = region.children[point.index]
        if point.slot >= len(child.inputs):
            return None
        tensor = child.inputs[point.slot]
        inside = {nodes[i].name for i in child.all_nodes()}
        cons = tuple((c.name, k) for c, k in g.consumers.get(tensor, []) if c.name in inside)
        return ResolvedPoint(tensor, cons) if cons else None
    if point.kind == "region_output":
        if point.slot != 0 or point.index >= len(region.outputs):
            return None
        tensor = region.outputs[point.index]
        return ResolvedPoint(tensor, None) if g.is_activation(tensor) else None
    raise ValueError(f"unknown insertion point kind {point.kind}")


def candidate_points(order: list[int], model: onnx.ModelProto, g: GraphIndex, placement: str,
                     allowed_nodes: set[str], quant_type: str) -> list[InsertionPoint]:
    """The points a search may toggle in a region whose nodes, in its pattern's order, are ``order``,
    shaped for the backend's fusions."""
    nodes = model.graph.node
    points: list[InsertionPoint] = []
    for k, idx in enumerate(order):
        node = nodes[idx]
        if node.name not in allowed_nodes:
            continue
        op = node.op_type
        if op in WEIGHTED_OPS and too_small(g, node, "fp8_e4m3fn" if quant_type == "fp8" else "int8"):
            continue
        acts = [s for s, t in enumerate(node.input) if g.is_activation(t)]
        if not computes_on(g, node):
            continue  # data on its way to graph outputs only: a Q/DQ there only costs precision
        if PLACEMENTS[placement].qlinear_groups:
            if op in WEIGHTED_OPS or op in ORT_INPUT_OPS:
                slots = acts[:1] if op in PASS_THROUGH_OPS else acts
                points += [InsertionPoint("node_input", k, s) for s in slots]
            if op in ORT_OUTPUT_OPS and acts:
                points.append(InsertionPoint("node_output", k))
        else:
            if op in WEIGHTED_OPS or (op == "Add" and len(acts) == 2):
                points += [InsertionPoint("node_input", k, s) for s in acts if s < 2]
    # region_output / child_input points are resolvable (custom schemes, caches) but not searched:
    # every placement here is expressible per consumer (node_input) or per producer (node_output),
    # and a second name for the same Q/DQ would only duplicate schemes
    return sorted(set(points))


def point_groups(points: list[InsertionPoint]) -> list[tuple[InsertionPoint, ...]]:
    """Points that belong together (a node's inputs and its output: one ORT fused group)."""
    by_node: dict[int, list[InsertionPoint]] = {}
    others: list[tuple[InsertionPoint, ...]] = []
    for p in points:
        if p.kind in ("node_input", "node_output", "activation_input", "weight"):
            by_node.setdefault(p.index, []).append(p)
        else:
            others.append((p,))
    return [tuple(v) for _, v in sorted(by_node.items())] + others
