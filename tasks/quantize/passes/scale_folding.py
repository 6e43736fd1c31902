"""Fold a constant scale on an activation x activation MatMul's output into a linear layer before it.

Attention computes softmax(Q K^T / sqrt(d)): the Div (or a Mul by 1/sqrt(d)) runs in float between the
integer MatMul and the Softmax once the MatMul is quantized, on a [heads, seq, seq] tensor. ORT fuses
it into FusedMatMul only in the float graph. Since (Q / c) K^T = (Q K^T) / c and the chain from the
query projection to the MatMul is linear (Reshape, Transpose, ...), the scale can move into the
projection's weights and bias, and the Div goes away. Float-exact up to the rounding of the rescaled
constants; the quantize stage keeps it only when the float outputs move by at most FLOAT_EXACT.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from tasks.quantize.passes.graph_edit import Editor, absorber, divide_along

# ops a scalar factor passes through unchanged: x * f reshaped is the reshaped x, times f
SCALE_TRANSPARENT = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def _scalar(ed: Editor, name: str) -> float | None:
    if not ed.is_float_const(name) or int(np.prod(ed.shape(name))) != 1:
        return None
    v = float(ed.array(name).reshape(()))
    return v if np.isfinite(v) and v != 0.0 else None


def _sole_reader(ed: Editor, tensor: str) -> bool:
    return tensor not in ed.outputs and len(ed.uses(tensor)) == 1


def _linear_source(ed: Editor, tensor: str) -> str | None:
    """The tensor before a chain of SCALE_TRANSPARENT ops ending in ``tensor``, each read only by the
    next: where a scalar factor on ``tensor`` can be applied instead."""
    while _sole_reader(ed, tensor):
        i = ed.producer(tensor)
        if i is None:
            return None
        node = ed.node(i)
        if node.op_type not in SCALE_TRANSPARENT:
            return tensor
        tensor = node.input[0]
    return None


def _scaled_matmul(ed: Editor, i: int) -> tuple[int, float] | None:
    """(index of the MatMul, the factor) when node ``i`` multiplies or divides the output of an
    activation x activation MatMul, read by nothing else, by a scalar constant."""
    node = ed.node(i)
    if node.op_type not in ("Div", "Mul") or len(node.input) != 2 or node.output[0] in ed.outputs:
        return None
    for j in (1,) if node.op_type == "Div" else (0, 1):
        c = _scalar(ed, node.input[j])
        x = node.input[1 - j]
        m = ed.producer(x)
        if c is None or m is None or not _sole_reader(ed, x):
            continue
        mm = ed.node(m)
        if mm.op_type == "MatMul" and not any(ed.is_const(t) for t in mm.input):
            return m, (1.0 / c if node.op_type == "Div" else c)
    return None


def fold_matmul_scales(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """(the model with each foldable scale moved into a linear producer of one MatMul input and its
    Div/Mul removed, one record per fold). The input model is not changed."""
    ed = Editor(model)
    changes: list[dict[str, Any]] = []
    folded: set[str] = set()
    for i in range(len(ed.graph.node)):
        found = _scaled_matmul(ed, i)
        if found is None:
            continue
        m, factor = found
        for t in ed.node(m).input:
            src = _linear_source(ed, t)
            absorb = absorber(ed, src, None) if src is not None else None
            if absorb is None:
                continue
            label, edits = absorb
            s = np.array(1.0 / factor)
            for e in edits:
                name = ed.node(e.node).input[e.index]
                ed.set_const(name, divide_along(ed.array(name), s, e.axis), [(e.node, e.index)])
            node = ed.node(i)
            ed.rewire(ed.uses(node.output[0]), ed.node(m).output[0])
            folded.add(node.name or node.output[0])
            changes.append({"node": node.name, "op": node.op_type, "factor": factor, "matmul": ed.node(m).name,
                            "into": f"{label} {ed.node(ed.producer(src)).name}"})
            break
    if not changes:
        return model, []
    out = ed.finish()
    dropped = [n for n in out.graph.node if (n.name or n.output[0]) in folded]
    keep = [n for n in out.graph.node if (n.name or n.output[0]) not in folded]
    del out.graph.node[:]
    out.graph.node.extend(keep)
    read = {t for n in keep for t in n.input} | {o.name for o in out.graph.output}
    orphans = {t for n in dropped for t in n.input if t not in read and t in ed.inits}
    if orphans:
        inits = [t for t in out.graph.initializer if t.name not in orphans]
        del out.graph.initializer[:]
        out.graph.initializer.extend(inits)
    return out, changes


__all__ = ["SCALE_TRANSPARENT", "fold_matmul_scales"]
