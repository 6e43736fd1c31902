"""Fusion groups: the units a runtime really fuses, as Regions of the original graph (subgraph mode,
phase 1).

ONNX Runtime: a session of the model is built with its optimized graph saved (level ``extended``:
every fusion, no NCHWc layout rewrite that would rename tensors), and each optimized node is mapped
back to the original nodes it replaced by its boundary tensors, never by node names (fusions rename
nodes; they keep the tensors at a group's edges). Optimized nodes joined by tensors the original
graph does not have (the Reshape -> Gemm -> Reshape a MatMul + Add fusion makes) form one group.
The original nodes of a group are those on the paths from its input tensors to its output tensors.

OpenVINO: the compiled model's runtime graph names, for each executed layer, the ONNX nodes fused
into it (``originalLayersNames``); grouped as TensorRT's layers are.

TensorRT: the layer information JSON (``trtexec --exportLayerInfo=graph.json
--profilingVerbosity=detailed``, or the engine inspector) names, in each layer's Metadata, the ONNX
nodes it was built from. Layers that share an ONNX node are one group (TensorRT may split a node
into a prologue kernel and the fused kernel); layers with no ONNX node (Reformat, Shuffle copies
TensorRT inserts) belong to none.

Each group is a LEAF ``Region``, so the region-mode machinery (RegionPattern signatures, insertion
points, schemes) applies to it unchanged: structurally identical groups share a signature.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from tasks.autotune.region.pattern import RegionPattern
from tasks.autotune.region.region import Region, RegionType


@dataclass(frozen=True)
class FusionGroup:
    """Original nodes the runtime runs as ``fused_ops`` (its own op types, in its graph order)."""

    region: Region
    names: tuple[str, ...]
    fused_ops: tuple[str, ...]
    signature: str


def map_fusions(original: onnx.ModelProto, optimized: onnx.ModelProto) -> list[FusionGroup]:
    """Fusion groups of ``original`` as ``optimized`` (the runtime's graph of it) runs them, in the
    original graph's order. Original nodes with no path to a group (folded constants) belong to none."""
    og = original.graph
    inits = {i.name for i in og.initializer}
    known = inits | {i.name for i in og.input} | {o for n in og.node for o in n.output}
    producer = {o: k for k, n in enumerate(og.node) for o in n.output}

    # optimized nodes joined through tensors the original graph does not have form one group
    opt = list(optimized.graph.node)
    opt_producer = {o: k for k, n in enumerate(opt) for o in n.output}
    members = _connected(len(opt), [(k, opt_producer[t]) for k, n in enumerate(opt) for t in n.input
                                    if t and t not in known and t in opt_producer])

    groups: list[tuple[list[int], list[str], list[str], tuple[str, ...]]] = []
    claimed: set[int] = set()
    for ks in members:
        inside = {o for k in ks for o in opt[k].output}
        ins = sorted({t for k in ks for t in opt[k].input if t and t in known and t not in inside})
        outs = sorted({t for k in ks for t in opt[k].output if t in known})
        nodes: set[int] = set()
        stack = [producer[t] for t in outs if t in producer]
        while stack:
            i = stack.pop()
            if i in nodes or i in claimed:
                continue
            nodes.add(i)
            for t in og.node[i].input:
                if t and t not in ins and t not in inits and t in producer:
                    stack.append(producer[t])
        if not nodes:
            continue  # runtime-only nodes (a cast, a reorder) with no original counterpart
        claimed |= nodes
        groups.append((sorted(nodes), [t for t in ins if t not in inits], outs, tuple(opt[k].op_type for k in ks)))

    return _as_groups(original, [(nodes, ins, outs, fused) for nodes, ins, outs, fused in groups])


def _connected(n: int, links: list[tuple[int, int]]) -> list[list[int]]:
    """Items 0..n-1 grouped by the links between them (union-find), each group in item order."""
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in links:
        parent[find(a)] = find(b)
    groups: dict[int, list[int]] = {}
    for k in range(n):
        groups.setdefault(find(k), []).append(k)
    return list(groups.values())


def _as_groups(model: onnx.ModelProto, groups: list[tuple[list[int], list[str], list[str], tuple[str, ...]]],
               index=None) -> list[FusionGroup]:
    from pipeline.graph.index import GraphIndex

    index = index or GraphIndex(model)
    out: list[FusionGroup] = []
    for gid, (nodes, ins, outs, fused) in enumerate(sorted(groups, key=lambda g: g[0][0])):
        region = Region(gid, RegionType.LEAF, 1, nodes=nodes, inputs=ins, outputs=outs)
        pattern, _ = RegionPattern.with_order(region, model, index)
        out.append(FusionGroup(region, tuple(model.graph.node[i].name for i in nodes), fused, pattern.signature))
    return out


def layer_fusion_groups(model: onnx.ModelProto, layer_info: dict) -> list[FusionGroup]:
    """Fusion groups of ``model`` from a runtime's per-layer information: TensorRT's (as
    ``parse_layer_info`` returns it, or the raw --exportLayerInfo JSON) or OpenVINO's runtime graph
    (``OpenVinoBackend.layer_info``); each layer names the ONNX nodes it was built from."""
    from pipeline.graph.layer_info import parse_layer_info

    if "layers" not in layer_info:
        layer_info = parse_layer_info(layer_info, "graph json")
    from pipeline.graph.index import GraphIndex

    index = GraphIndex(model)
    names = {n.name: k for k, n in enumerate(model.graph.node)}
    layers = [(rec, [names[x] for x in rec.get("onnx_nodes", []) if x in names]) for rec in layer_info["layers"]]
    layers = [(rec, nodes) for rec, nodes in layers if nodes]
    owner: dict[int, int] = {}
    for k, (_, nodes) in enumerate(layers):
        for n in nodes:
            owner.setdefault(n, k)
    groups = []
    for ks in _connected(len(layers), [(k, owner[n]) for k, (_, nodes) in enumerate(layers) for n in nodes]):
        nodes = sorted({n for k in ks for n in layers[k][1]})
        ins, outs = index.boundaries(nodes)
        groups.append((nodes, ins, outs, tuple(str(layers[k][0].get("LayerType", "?")) for k in ks)))
    return _as_groups(model, groups, index)
