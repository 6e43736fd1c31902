"""Folding what is computable ahead of time: Constant nodes and constant subgraphs into initializers
(onnx-graphsurgeon), BatchNormalization into the Conv before it, Identity aliases of weights."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from pipeline.graph import weights
from pipeline.graph.model import WEIGHTED_OPS, subgraphs
from pipeline.graph.weights import without_initializers

NOTHING_FOLDED = {"constant_nodes": 0, "constant_weights": 0, "nodes_removed": 0}


def constant_weights(model: onnx.ModelProto) -> int:
    """Weighted ops (main graph) whose weight input comes from a Constant node, not an initializer."""
    consts = {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    return sum(1 for n in model.graph.node if n.op_type in WEIGHTED_OPS and len(n.input) > 1 and n.input[1] in consts)


def fold_constants(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Constant nodes and constant subgraphs (shape arithmetic on constants) folded into initializers.

    paddle2onnx and tf2onnx store weights as Constant nodes; a weight is a weight wherever it lives, so
    every later stage sees them as initializers. onnx-graphsurgeon evaluates what it folds with ONNX
    Runtime (also inside If/Loop bodies). Returns the model (unchanged when there is nothing to fold)
    and counts: Constant nodes before and after, weights that came from Constant nodes.
    """
    def constants(m: onnx.ModelProto) -> int:
        return sum(1 for n in m.graph.node if n.op_type == "Constant")

    before, from_constants = constants(model), constant_weights(model)
    if not _foldable(model):  # onnx-graphsurgeon would copy every weight to find nothing
        return model, dict(NOTHING_FOLDED)
    out = fold_graph(model)
    removed = len(model.graph.node) - len(out.graph.node)
    if removed <= 0 and before == 0:
        return model, dict(NOTHING_FOLDED)
    return out, {"constant_nodes": before - constants(out), "constant_weights": from_constants, "nodes_removed": removed}


def _foldable(model: onnx.ModelProto) -> bool:
    """Whether a node of the main graph is a Constant, reads a shape (static once shapes are), computes
    from constants only, or holds a body: what onnx-graphsurgeon's folding could change."""
    known = {i.name for i in model.graph.initializer}
    for n in model.graph.node:
        if (n.op_type in ("Constant", "Shape", "Size") or subgraphs(n)
                or (n.input and all(i in known or not i for i in n.input))):
            return True
    return False


def fold_graph(model: onnx.ModelProto, flatten_subgraphs: bool = True) -> onnx.ModelProto:
    """``model`` with what is computable from constants folded by onnx-graphsurgeon (evaluated with ONNX
    Runtime, inside If/Loop bodies too; ``flatten_subgraphs``: an If whose condition folds is inlined as
    well), cleaned up and topologically sorted; IR version, producer and metadata stay the model's."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(_readable(model))
    graph.fold_constants(flatten_subgraphs=flatten_subgraphs).cleanup().toposort()
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    out.producer_name, out.producer_version = model.producer_name, model.producer_version
    del out.metadata_props[:]
    out.metadata_props.extend(model.metadata_props)
    return out


def _readable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as onnx-graphsurgeon can fold it. gs reads a TensorProto's values itself (onnx's
    to_array) and hands ONNX Runtime serialized bytes, so a tensor kept on disk (pipeline.graph.weights) is
    readable by neither: the ones feeding a node computable from constants are read into a copy (the
    rest stay references; gs exports a tensor it never read as the TensorProto it was given)."""
    if not weights.has_lazy(model):
        return model
    known = {i.name for i in model.graph.initializer}
    needed = {i for n in model.graph.node if n.input and all(i in known or not i for i in n.input) for i in n.input}
    if not any(weights.is_lazy(t) and t.name in needed for t in model.graph.initializer):
        return model
    out = without_initializers(model)
    out.graph.initializer.extend(numpy_helper.from_array(weights.array(t), t.name)
                                 if weights.is_lazy(t) and t.name in needed else t for t in model.graph.initializer)
    return out


def fold_batchnorm(model: onnx.ModelProto) -> int:
    """Fold inference BatchNormalization nodes into the Conv feeding them (in place); returns how many.

    Exporters such as paddle2onnx keep BatchNormalization separate; ONNX Runtime fuses it into the
    Conv in a float model, but a Q/DQ pair between the two blocks that fusion and leaves a float op
    between integer kernels. W' = W * g / sqrt(v + eps) per output channel, b' = (b - m) * g /
    sqrt(v + eps) + beta.
    """

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    consumers: dict[str, int] = {}
    for n in g.node:
        for t in n.input:
            consumers[t] = consumers.get(t, 0) + 1
    producer = {o: n for n in g.node for o in n.output}
    outputs = {o.name for o in g.output}
    drop: list[onnx.NodeProto] = []
    for bn in g.node:
        if bn.op_type != "BatchNormalization" or len(bn.output) != 1 or len(bn.input) != 5:
            continue
        conv = producer.get(bn.input[0])
        if (conv is None or conv.op_type != "Conv" or consumers.get(conv.output[0]) != 1
                or conv.output[0] in outputs or len(conv.input) < 2 or conv.input[1] not in inits
                or not all(t in inits for t in bn.input[1:])
                or (len(conv.input) > 2 and conv.input[2] and conv.input[2] not in inits)):
            continue
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        gamma, beta, mean, var = (weights.array(inits[t]).astype(np.float64) for t in bn.input[1:])
        w_init = inits[conv.input[1]]
        w = weights.array(w_init).astype(np.float64)
        b = (weights.array(inits[conv.input[2]]).astype(np.float64)
             if len(conv.input) > 2 and conv.input[2] else np.zeros(w.shape[0]))
        if gamma.shape != (w.shape[0],) or consumers.get(conv.input[1]) != 1:
            continue  # a shared weight cannot take one BN's factors
        factor = gamma / np.sqrt(var + eps)
        dtype = weights.array(w_init).dtype
        new_w = numpy_helper.from_array((w * factor.reshape(-1, *([1] * (w.ndim - 1)))).astype(dtype), conv.input[1])
        new_b_name = f"{conv.name or conv.output[0]}_folded_bias"
        new_b = numpy_helper.from_array(((b - mean) * factor + beta).astype(dtype), new_b_name)
        w_init.CopyFrom(new_w)
        g.initializer.append(new_b)
        inits[new_b_name] = new_b
        while len(conv.input) < 3:
            conv.input.append("")
        conv.input[2] = new_b_name
        conv.output[0] = bn.output[0]
        drop.append(bn)
    for bn in drop:
        g.node.remove(bn)
    if drop:
        used = {t for n in g.node for t in n.input} | outputs
        keep = [i for i in g.initializer if i.name in used]
        del g.initializer[:]
        g.initializer.extend(keep)
    return len(drop)


def fold_constant_identities(model: onnx.ModelProto) -> int:
    """Bypass Identity nodes whose input is an initializer (exporters use them to share
    deduplicated weights), so every weight and bias is visible as an initializer. Returns count."""
    inits = {i.name for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    alias: dict[str, str] = {}
    keep = []
    for node in model.graph.node:
        src = alias.get(node.input[0], node.input[0]) if node.input else ""
        if node.op_type == "Identity" and src in inits and node.output[0] not in outputs:
            alias[node.output[0]] = src
        else:
            keep.append(node)
    if not alias:
        return 0
    for node in keep:
        for i, name in enumerate(node.input):
            if name in alias:
                node.input[i] = alias[name]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return len(alias)
