"""Shape inference for models of any size.

onnx's own inference serializes the whole model (and cannot past 2 GB); ``infer_shapes`` runs it on a
weightless skeleton for large models, which carries every constant's dims and type and the values of
small ones (what inference reads: Reshape shapes, axes, ...).
"""

from __future__ import annotations

import onnx

from pipeline.graph import weights
from pipeline.graph.weights import fits_one_proto, without_initializers

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
        if fits_one_proto(model) and model.ByteSize() < _SKELETON_FROM and not weights.has_lazy(model):
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


__all__ = ["infer_shapes", "skeleton"]
