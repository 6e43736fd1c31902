"""Region patterns: deterministic structural signatures shared by structurally identical regions.

The signature covers, for every node in a canonical order, its op type, the attributes that select
kernels (everything but names and tensor payloads), how its inputs connect (to which earlier node
of the region, to a constant, or to the region boundary) and how the region splits into children.
Weight shapes are left out on purpose: every residual block of a ResNet stage, or every layer of a
transformer, is one pattern, and a scheme found on one model transfers to its siblings.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import onnx

from pipeline.graph.index import GraphIndex
from pipeline.graph.model import topological_order
from tasks.autotune.region.region import Region


def _attr_signature(node: onnx.NodeProto) -> str:
    parts = []
    for a in sorted(node.attribute, key=lambda a: a.name):
        if a.type == onnx.AttributeProto.TENSOR:
            v: object = ("tensor", tuple(a.t.dims), a.t.data_type)
        elif a.type == onnx.AttributeProto.GRAPH:
            v = ("graph", len(a.g.node))
        else:
            v = onnx.helper.get_attribute_value(a)
            if isinstance(v, bytes):
                v = v.decode(errors="replace")
            if isinstance(v, list):
                v = tuple(x.decode(errors="replace") if isinstance(x, bytes) else x for x in v)
        parts.append(f"{a.name}={v}")
    return ",".join(parts)


def canonical_order(region: Region, model: onnx.ModelProto, index: GraphIndex) -> list[int]:
    """Region nodes in a topological order that depends on structure only (ties: op type, attributes,
    then graph order, which exporters keep consistent across repeated blocks)."""
    nodes = region.all_nodes()
    graph_nodes = model.graph.node
    producer_idx = {o: i for i in nodes for o in graph_nodes[i].output}
    order = topological_order(nodes, lambda i: (producer_idx[t] for t in graph_nodes[i].input if t in producer_idx),
                              lambda i: (graph_nodes[i].op_type, _attr_signature(graph_nodes[i]), i))
    if len(order) != len(nodes):  # not a DAG inside the region: fall back to graph order
        return nodes
    return order


@dataclass(frozen=True)
class RegionPattern:
    """Structural identity of a region; ``signature`` is the key schemes and caches are stored under."""

    signature: str
    num_nodes: int
    op_types: tuple[str, ...]

    @property
    def short(self) -> str:
        return self.signature[:12]

    @classmethod
    def from_region(cls, region: Region, model: onnx.ModelProto, index: GraphIndex | None = None) -> RegionPattern:
        return cls.with_order(region, model, index)[0]

    @classmethod
    def with_order(cls, region: Region, model: onnx.ModelProto,
                   index: GraphIndex | None = None) -> tuple[RegionPattern, list[int]]:
        g = index or GraphIndex(model)
        order = canonical_order(region, model, g)
        pos = {n: k for k, n in enumerate(order)}
        graph_nodes = model.graph.node
        produced = {o: (pos[i], j) for i in order for j, o in enumerate(graph_nodes[i].output)}
        parts = []
        for i in order:
            node = graph_nodes[i]
            ins = []
            for t in node.input:
                if not t:
                    ins.append("-")
                elif t in produced:
                    ins.append(f"n{produced[t][0]}.{produced[t][1]}")
                elif t in g.constants:
                    ins.append("c")
                else:
                    ins.append("b")
            parts.append(f"{node.op_type}[{_attr_signature(node)}]({' '.join(ins)})")
        outs = sorted(f"n{produced[t][0]}.{produced[t][1]}" for t in region.outputs if t in produced)
        children = sorted(tuple(sorted(pos[n] for n in c.all_nodes() if n in pos)) for c in region.children)
        text = "|".join(parts) + "=>" + ",".join(outs) + "#" + repr(children) + f"@{region.type.value}"
        sig = hashlib.sha256(text.encode()).hexdigest()[:24]
        pattern = cls(sig, len(order), tuple(graph_nodes[i].op_type for i in order))
        return pattern, order
