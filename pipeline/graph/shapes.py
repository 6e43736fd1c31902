"""Shape inference for models of any size.

onnx's own inference serializes the whole model (and cannot past 2 GB); ``infer_shapes`` runs it on a
weightless skeleton for large models, which carries every constant's dims and type and the values of
small ones (what inference reads: Reshape shapes, axes, ...).
"""

from __future__ import annotations

import math

import onnx

from pipeline.graph import weights
from pipeline.graph.weights import proto_size_bound, without_initializers

_SKELETON_KEEP = 1024  # constants up to this many bytes keep their values in a skeleton (Reshape shapes, ...)
_SKELETON_FROM = 64 * 2**20  # models above this many bytes are shape-inferred through a skeleton


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without the values of its large constants (their dims and types stay): what shape
    inference needs, at a fraction of the size."""
    sk = without_initializers(model)
    g = sk.graph
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or t.ByteSize() > _SKELETON_KEEP:
            g.initializer.append(onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims))
        else:
            g.initializer.append(t)
    return sk


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its tensors' types and shapes inferred (best effort: custom ops, failures leave
    it as it was). A large model (past 2 GB onnx's own inference cannot serialize it) is inferred
    through a weightless skeleton and its value_info and outputs are updated in place."""
    try:
        if proto_size_bound(model) < _SKELETON_FROM and not weights.has_lazy(model):
            return onnx.shape_inference.infer_shapes(model, strict_mode=False)
        inferred = onnx.shape_inference.infer_shapes(skeleton(model), strict_mode=False)
    except Exception:  # noqa: BLE001 - shape inference is best effort for custom ops
        return model
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    for mine, theirs in zip(model.graph.output, inferred.graph.output, strict=True):
        mine.CopyFrom(theirs)
    for mine, theirs in zip(model.graph.node, inferred.graph.node, strict=True):
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in mine.attribute):
            mine.CopyFrom(theirs)  # bodies carry their own inferred value_info
    return model


def _dims(vi_or_tensor) -> list[int] | None:
    if isinstance(vi_or_tensor, onnx.TensorProto):
        return list(vi_or_tensor.dims)
    dims = [d.dim_value if d.HasField("dim_value") else 0 for d in vi_or_tensor.type.tensor_type.shape.dim]
    # a symbolic dim (a dynamic batch) counts as 1: the same factor in every node, the order stays
    return [d if d > 0 else 1 for d in dims] if dims else None


def node_macs(model: onnx.ModelProto) -> dict[str, int]:
    """Multiply-accumulates of each Conv, ConvTranspose, MatMul and Gemm of the main graph, from its
    recorded shapes (value_info, initializer dims; a symbolic dim counts as 1); an op whose shapes are
    unknown is left out. What a node costs to run, to weigh which nodes are worth quantizing."""
    known = {vi.name: vi for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]}
    known.update({t.name: t for t in model.graph.initializer})

    def dims(name: str) -> list[int] | None:
        return _dims(known[name]) if name in known else None

    macs: dict[str, int] = {}
    for n in model.graph.node:
        if n.op_type not in ("Conv", "ConvTranspose", "MatMul", "Gemm") or len(n.input) < 2:
            continue
        x, w = dims(n.input[0]), dims(n.input[1])
        y = dims(n.output[0]) if n.op_type != "ConvTranspose" else None
        if not x or not w:
            continue
        if n.op_type == "Conv" and y:
            macs[n.name] = math.prod(y) * math.prod(w[1:])  # each output: C_in / group x kernel
        elif n.op_type == "ConvTranspose":
            macs[n.name] = math.prod(x) * math.prod(w[1:])  # each input: C_out / group x kernel
        elif n.op_type in ("MatMul", "Gemm") and len(w) >= 2:
            trans_b = n.op_type == "Gemm" and any(a.name == "transB" and a.i for a in n.attribute)
            macs[n.name] = math.prod(x) * (w[-2] if trans_b else w[-1])  # each input element: N outputs
    return macs


__all__ = ["infer_shapes", "node_macs", "skeleton"]
