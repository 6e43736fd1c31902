"""Regions: hierarchical subgraphs of an ONNX graph with explicit boundaries.

A LEAF region owns nodes directly; a COMPOSITE region groups child regions (and may own a few
nodes of its own); the ROOT covers the whole graph. Node references are indices into
``model.graph.node``, so regions stay valid for any copy of the same float graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RegionType(str, Enum):
    LEAF = "LEAF"
    COMPOSITE = "COMPOSITE"
    ROOT = "ROOT"


@dataclass(eq=False)
class Region:
    id: int
    type: RegionType
    level: int  # depth in the hierarchy: ROOT = 0
    nodes: list[int] = field(default_factory=list)  # nodes owned directly (graph.node indices)
    children: list[Region] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # activation tensors consumed inside, produced outside
    outputs: list[str] = field(default_factory=list)  # tensors produced inside, consumed outside or graph outputs
    parent: Region | None = field(default=None, repr=False)

    def all_nodes(self) -> list[int]:
        """Every node in this region and its descendants, sorted by graph order."""
        out = set(self.nodes)
        for c in self.children:
            out.update(c.all_nodes())
        return sorted(out)

    def descendants(self) -> list[Region]:
        out: list[Region] = []
        for c in self.children:
            out.append(c)
            out.extend(c.descendants())
        return out

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return (f"Region(id={self.id}, {self.type.value}, level={self.level}, nodes={len(self.all_nodes())}, "
                f"children={len(self.children)}, inputs={len(self.inputs)}, outputs={len(self.outputs)})")
