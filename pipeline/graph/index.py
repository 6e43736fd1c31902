"""The graph index every placement, calibration and insertion tool reads a graph through.

``GraphIndex`` holds a graph's nodes by name, its initializers, each tensor's producer and consumers,
which tensors are constants (initializers and what is computed from them alone) and which are float
activations. A Loop/Scan body seen as a graph of its own (``pipeline.graph.bodies``) marks the activations
it reads from the enclosing graph in its metadata (``OUTER_SCOPE_KEY``, read by ``outer_scope``): they
are not graph inputs of the body for placement. Beside it, where a weighted op's weight and bias are
(``weight_inputs``, ``bias_slot``, ``bias_tensor``).
"""

from __future__ import annotations

import json
from collections import defaultdict

import onnx

from pipeline.graph.model import WEIGHTED_OPS, implicit_inputs

# metadata key of a body view: the outer-scope activations among its graph inputs (a JSON list)
OUTER_SCOPE_KEY = "qdq_tune.outer_scope"
# activations right after an op that its output Q goes after (see GraphIndex.tail)
ACTIVATION_TAILS = ("Relu", "Clip")


def outer_scope(model: onnx.ModelProto) -> frozenset[str]:
    """The graph inputs of a body view that are activations of an enclosing graph (empty for a model)."""
    for p in model.metadata_props:
        if p.key == OUTER_SCOPE_KEY:
            return frozenset(json.loads(p.value))
    return frozenset()


class GraphIndex:
    """Producers, consumers and constants of a graph, for placement, calibration and Q/DQ insertion."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        g = model.graph
        self.nodes = {n.name: n for n in g.node}
        self.inits = {i.name: i for i in g.initializer}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        for n in g.node:
            for o in n.output:
                self.producer[o] = n
            for idx, i in enumerate(n.input):
                if i:
                    self.consumers[i].append((n, idx))
        # a body view's outer-scope activations are made (and quantized, if at all) outside the body
        self.graph_inputs = {i.name for i in g.input if i.name not in self.inits} - outer_scope(model)
        self.graph_outputs = {o.name for o in g.output}
        self.constants = set(self.inits)
        for n in g.node:  # constant-foldable subgraphs (Constant, shape arithmetic on constants)
            reads = [*n.input, *implicit_inputs(n)]  # a Loop on constants may read an input in its body
            if n.op_type == "Constant" or (reads and all(i in self.constants or not i for i in reads)):
                self.constants.update(n.output)
        types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.value_info, *g.output]}
        self.float_tensors = {k for k, t in types.items() if t in (1, 10, 16)}

    def is_activation(self, tensor: str) -> bool:
        return bool(tensor) and tensor not in self.constants and tensor in self.float_tensors

    def boundaries(self, nodes: list[int]) -> tuple[list[str], list[str]]:
        """(inputs, outputs) of a set of graph.node indices: the non-initializer tensors it reads from
        outside, in first-use order, and the tensors it produces that a node outside reads or that
        are graph outputs, in production order."""
        graph_nodes = self.model.graph.node
        members = [graph_nodes[i] for i in nodes]
        inside = {n.name for n in members}
        produced = [o for n in members for o in n.output if o]
        mine = set(produced)
        ins = list(dict.fromkeys(t for n in members for t in n.input
                                 if t and t not in mine and t not in self.inits))
        outs = [t for t in produced if t in self.graph_outputs
                or any(c.name not in inside for c, _ in self.consumers.get(t, ()))]
        return ins, outs

    def weight_shape(self, tensor: str) -> tuple[int, ...]:
        """Shape of an initializer, read from its header (no decoding of the values)."""
        return tuple(int(d) for d in self.inits[tensor].dims)

    def bias_add(self, node: onnx.NodeProto) -> tuple[onnx.NodeProto, int] | None:
        """For a MatMul followed only by an Add of a constant (its bias): that Add and the bias slot."""
        if node.op_type != "MatMul" or node.output[0] in self.graph_outputs:
            return None
        cons = self.consumers.get(node.output[0], [])
        if len(cons) != 1 or cons[0][0].op_type != "Add":
            return None
        add = cons[0][0]
        slots = [i for i, t in enumerate(add.input) if t in self.inits]
        return (add, slots[0]) if len(slots) == 1 and len(add.input) == 2 else None

    def tail(self, node: onnx.NodeProto) -> str:
        """Where the node's output Q goes: after a directly following bias Add (MatMul: ORT fuses
        MatMul+Add into one Gemm) and Relu/Clip (folded into the Q when its zero point is at the
        bottom of the range)."""
        out = node.output[0]
        bias = self.bias_add(node)
        if bias is not None:
            out = bias[0].output[0]
        while True:
            cons = self.consumers.get(out, [])
            if len(cons) == 1 and cons[0][0].op_type in ACTIVATION_TAILS and out not in self.graph_outputs:
                out = cons[0][0].output[0]
            else:
                return out


def weight_inputs(g: GraphIndex, node: onnx.NodeProto) -> list[int]:
    """Input indices of a weighted op's weight: [1] when it is an initializer, else none."""
    if node.op_type in WEIGHTED_OPS and len(node.input) > 1 and node.input[1] in g.inits:
        return [1]
    return []


def bias_slot(g: GraphIndex, node: onnx.NodeProto) -> tuple[str, int] | None:
    """(node name, input index) of a weighted op's bias: Gemm's C, or the constant of a MatMul's bias Add."""
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] in g.inits:
        return node.name, 2
    if node.op_type == "MatMul":
        b = g.bias_add(node)
        if b is not None:
            return b[0].name, b[1]
    return None


def bias_tensor(g: GraphIndex, node: onnx.NodeProto) -> tuple[str, str, int] | None:
    """(bias initializer, tensor it is added into, that tensor's channel axis) of a weighted op:
    a Conv's B, a Gemm's C, or the constant of a MatMul's bias Add."""
    if node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 2 and node.input[2] in g.inits:
        return node.input[2], node.output[0], 1
    slot = bias_slot(g, node)
    if slot is None:
        return None
    owner = g.nodes[slot[0]]
    return owner.input[slot[1]], owner.output[0], -1


# ops that only reshape: a runtime moves a DequantizeLinear through them to the op that reads the result
SHAPE_ONLY_OPS = ("Flatten", "Reshape", "Squeeze", "Unsqueeze")


def through_shape_ops(g: GraphIndex, tensor: str) -> tuple[str, tuple[str, int] | None]:
    """The tensor ``tensor`` is a reshape of, back through shape-only ops each read once (a graph
    output on the way ends the walk: it is read outside), and that tensor's reader on the way (None
    when there is no shape-only op: ``tensor`` itself)."""
    t, reader = tensor, None
    while ((p := g.producer.get(t)) is not None and p.op_type in SHAPE_ONLY_OPS and len(g.consumers[t]) == 1
           and t not in g.graph_outputs):
        t, reader = p.input[0], (p.name, 0)
    return t, reader


# ops that only move or select data: an int8 copy of their input is only worth making for a reader
# past them that computes
MOVE_ONLY_OPS = ("Concat", "Flatten", "Gather", "Identity", "Reshape", "Slice", "Split", "Squeeze", "Transpose",
                 "Unsqueeze")


def computes_on(g: GraphIndex, node: onnx.NodeProto) -> bool:
    """Whether ``node`` computes on its inputs, or passes them through ops that only move data to one that
    does (``reaches_compute``): a reader that only carries a tensor to graph outputs gains nothing from a
    Q/DQ on it."""
    return node.op_type not in MOVE_ONLY_OPS or any(reaches_compute(g, o) for o in node.output if o)


def reaches_compute(g: GraphIndex, tensor: str) -> bool:
    """Whether ``tensor``'s readers, followed through ops that only move data, include an op that
    computes. A tensor that only reaches graph outputs (a recurrent state, a model output) gains
    nothing from a Q/DQ: it only loses precision where the user reads it."""
    seen, stack = set(), [tensor]
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        for node, _ in g.consumers.get(t, []):
            if node.op_type not in MOVE_ONLY_OPS:
                return True
            stack.extend(o for o in node.output if o)
    return False
