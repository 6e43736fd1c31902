"""LSTM nodes lowered to MatMul and element-wise ops, so that their matrix products can be quantized.

An ONNX LSTM is one opaque node: ONNX Runtime has no Q/DQ form of it and TensorRT builds it as a loop
of its own, so its weights (often most of a streaming audio model's) stay float. With a static
sequence length it unrolls exactly (ONNX LSTM definition, gates in i, o, f, c order):

    XW  = X @ W^T + (Wb + Rb)                      one MatMul over all time steps
    g_t = XW[t] + H_{t-1} @ R^T                    one MatMul per step
    C_t = sigmoid(f) * C_{t-1} + sigmoid(i) * tanh(c),  H_t = sigmoid(o) * tanh(C_t)

Only the forms that unroll exactly are lowered: forward direction, default activations, no clip,
peepholes, sequence_lens or input_forget, layout 0, constant W/R/B, at most MAX_STEPS steps. Every
other LSTM stays as it is, with the reason in the record.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline.graph import weights
from pipeline.graph.model import opset_version
from pipeline.graph.shapes import infer_shapes

MAX_STEPS = 64  # longer sequences stay one LSTM node: the unrolled graph would grow with every step
_DEFAULT_ACTS = (b"Sigmoid", b"Tanh", b"Tanh")


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    inferred = infer_shapes(model)
    out = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim]
        if dims and all(d > 0 for d in dims):
            out[vi.name] = dims
    return out


def _why_not(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], shapes: dict[str, list[int]]) -> str | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("direction", b"forward") != b"forward":
        return f"direction {attrs['direction'].decode()}"
    if "activations" in attrs and tuple(attrs["activations"]) != _DEFAULT_ACTS:
        return "non-default activations"
    for name in ("clip", "activation_alpha", "activation_beta"):
        if name in attrs:
            return f"attribute {name}"
    if "hidden_size" not in attrs:  # optional in the spec, where it is inferred from R's shape
        return "no hidden_size attribute"
    if attrs.get("input_forget", 0) or attrs.get("layout", 0):
        return "input_forget or layout 1"
    inputs = list(node.input) + [""] * (8 - len(node.input))
    if inputs[4] or inputs[7]:
        return "sequence_lens or peepholes"
    if inputs[1] not in inits or inputs[2] not in inits or (inputs[3] and inputs[3] not in inits):
        return "W, R or B is not a constant"
    x = shapes.get(inputs[0])
    if x is None or len(x) != 3:
        return "the input's shape is not static"
    if x[0] > MAX_STEPS:
        return f"{x[0]} time steps (> {MAX_STEPS})"
    return None


class _Emitter:
    """Nodes and initializers of one lowered LSTM, named under its node's name."""

    def __init__(self, prefix: str, opset: int):
        self.prefix, self.opset = prefix, opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, what: str) -> str:
        self.count += 1
        return f"{self.prefix}/{what}_{self.count}"

    def const(self, what: str, value: np.ndarray) -> str:
        name = self.name(what)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: Any) -> str:
        out = out or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.name(op_type), **attrs))
        return out

    def axes_op(self, op_type: str, x: str, axes: list[int], out: str | None = None) -> str:
        """Squeeze / Unsqueeze: axes are an input from opset 13 on, an attribute before."""
        if self.opset >= 13:
            return self.op(op_type, [x, self.const("axes", np.array(axes, np.int64))], out)
        return self.op(op_type, [x], out, axes=axes)


def _lower(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], shapes: dict[str, list[int]],
           opset: int) -> _Emitter:
    steps, batch, _ = shapes[node.input[0]]
    hidden = int(helper.get_attribute_value(next(a for a in node.attribute if a.name == "hidden_size")))
    inputs = list(node.input) + [""] * (8 - len(node.input))
    w = weights.array(inits[inputs[1]])[0]  # [4H, in]
    r = weights.array(inits[inputs[2]])[0]  # [4H, H]
    b = weights.array(inits[inputs[3]])[0] if inputs[3] else np.zeros(8 * hidden, w.dtype)
    e = _Emitter(f"{node.name}/lowered", opset)
    xw = e.op("MatMul", [inputs[0], e.const("W_t", np.ascontiguousarray(w.T))])
    xw = e.op("Add", [xw, e.const("bias", b[:4 * hidden] + b[4 * hidden:])])
    r_t = e.const("R_t", np.ascontiguousarray(r.T))

    def initial(i: int, what: str) -> str:
        if inputs[i]:
            return e.axes_op("Squeeze", inputs[i], [0])
        return e.const(what, np.zeros((batch, hidden), w.dtype))

    h, c = initial(5, "h0"), initial(6, "c0")
    gate = {k: (e.const(f"{k}_start", np.array([j * hidden], np.int64)),
                e.const(f"{k}_end", np.array([(j + 1) * hidden], np.int64))) for j, k in enumerate("iofc")}
    last_axis = e.const("axis", np.array([-1], np.int64))
    hs = []
    for t in range(steps):
        x_t = e.op("Gather", [xw, e.const("t", np.array(t, np.int64))], axis=0)
        g = e.op("Add", [x_t, e.op("MatMul", [h, r_t])])
        part = {k: e.op("Slice", [g, s, end, last_axis]) for k, (s, end) in gate.items()}
        i_, o_, f_ = (e.op("Sigmoid", [part[k]]) for k in "iof")
        c = e.op("Add", [e.op("Mul", [f_, c]), e.op("Mul", [i_, e.op("Tanh", [part["c"]])])])
        h = e.op("Mul", [o_, e.op("Tanh", [c])])
        hs.append(h)
    outs = list(node.output) + [""] * (3 - len(node.output))
    if outs[0]:
        ys = [e.axes_op("Unsqueeze", x, [0, 1]) for x in hs]
        if len(ys) == 1:
            e.op("Identity", ys, outs[0])
        else:
            e.op("Concat", ys, outs[0], axis=0)
    if outs[1]:
        e.axes_op("Unsqueeze", h, [0], outs[1])
    if outs[2]:
        e.axes_op("Unsqueeze", c, [0], outs[2])
    return e


def lower_lstm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """(a copy of ``model`` with its main graph's LSTM nodes unrolled where that is exact, one record per
    LSTM: node, steps and MatMuls made, or why it was left as it is). The model itself when none is."""
    lstms = [n for n in model.graph.node if n.op_type == "LSTM"]
    if not lstms:
        return model, []
    inits = {i.name: i for i in model.graph.initializer}
    shapes = _static_shapes(model)
    opset = opset_version(model)
    records, nodes, new_inits = [], [], []
    for node in model.graph.node:
        if node.op_type != "LSTM":
            nodes.append(node)
            continue
        why = _why_not(node, inits, shapes)
        if why:
            records.append({"node": node.name, "lowered": False, "reason": why})
            nodes.append(node)
            continue
        e = _lower(node, inits, shapes, opset)
        nodes.extend(e.nodes)
        new_inits.extend(e.inits)
        records.append({"node": node.name, "lowered": True, "steps": shapes[node.input[0]][0],
                        "matmuls": sum(n.op_type == "MatMul" for n in e.nodes)})
    if not any(r["lowered"] for r in records):
        return model, records
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(new_inits)
    out = infer_shapes(out)  # element types of the new tensors: placement quantizes only typed float ones
    return out, records
