"""Which of a model's outputs hold class scores, when `accuracy.class_outputs` does not say.

Agreement counts the argmax of class scores; over an encoder's hidden states ([N, S, 768] of
`last_hidden_state`) an argmax names a feature, not a prediction, and a flip of it means nothing. So a
shape is not enough: ``guess_class_output`` reads the first output's name and the op that makes it
(through reshapes and casts). Class scores: a name saying so (logits, scores, probabilities, classes,
predictions), a Softmax or LogSoftmax, or a classifier head (a MatMul or Gemm whose width differs from
the width it reads). Features: a name saying so (hidden, embedding, features, pooler, token), a
LayerNormalization, a residual Add, an activation or a normalization. Anything else is unsure and is
judged as features (by SNR or cosine), in one line naming the key that changes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import onnx

from pipeline.graph.index import GraphIndex

CLASS_NAMES = re.compile(r"logit|score|prob|class|softmax|pred|label", re.IGNORECASE)
FEATURE_NAMES = re.compile(r"hidden|embed|feature|pool|token|state|encod", re.IGNORECASE)
CLASS_OPS = ("Softmax", "LogSoftmax", "ArgMax")
# ops whose output is a representation: normalizations, residual sums, activations
FEATURE_OPS = ("LayerNormalization", "SkipLayerNormalization", "Add", "Tanh", "Relu", "Gelu", "Erf", "Mul", "Div",
               "ReduceMean", "Sigmoid", "Concat", "BatchNormalization", "GlobalAveragePool", "Sqrt")
PASS_THROUGH = ("Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast", "DequantizeLinear",
                "QuantizeLinear")


@dataclass(frozen=True)
class ClassGuess:
    """The guess for one output: whether it holds class scores, how sure, and why (for the log line)."""

    output: str
    classes: bool
    sure: bool
    why: str

    def line(self) -> str:
        """What the run says about it: the metric it gets and the key that changes that."""
        if self.classes:
            return (f"accuracy: output '{self.output}' holds class scores ({self.why}): top-1 agreement is counted "
                    f"on it; accuracy.class_outputs=[] judges it by SNR instead")
        unsure = "" if self.sure else "not clearly class scores; "
        return (f"accuracy: output '{self.output}' is judged by SNR or cosine, not argmax agreement ({unsure}{self.why}); "
                f"accuracy.class_outputs=[{self.output}] counts top-1 agreement on it")


def guess_class_output(model: onnx.ModelProto) -> ClassGuess | None:
    """The guess for ``model``'s first output (None for a model without outputs)."""
    if not model.graph.output:
        return None
    name = model.graph.output[0].name
    if CLASS_NAMES.search(name):
        return ClassGuess(name, True, True, "its name says so")
    if FEATURE_NAMES.search(name):
        return ClassGuess(name, False, True, "its name says it holds features")
    index = GraphIndex(model)
    node = index.producer.get(name)
    while node is not None and node.op_type in PASS_THROUGH:
        node = index.producer.get(node.input[0]) if node.input else None
    if node is None:
        return ClassGuess(name, False, False, "no op makes it here")
    if node.op_type in CLASS_OPS:
        return ClassGuess(name, True, True, f"a {node.op_type} makes it")
    if node.op_type == "Add":  # a bias after a MatMul is still the head; a residual sum is not
        head = next((index.producer[i] for i in node.input if i in index.producer
                     and index.producer[i].op_type in ("MatMul", "Gemm")), None)
        node = head or node
    if node.op_type in ("MatMul", "Gemm"):
        widths = _widths(node, index)
        if widths is None:
            return ClassGuess(name, False, False, f"a {node.op_type} of unknown width makes it")
        k, n = widths
        if n != k:
            return ClassGuess(name, True, True, f"a {node.op_type} classifier head, {k} -> {n}")
        return ClassGuess(name, False, False, f"a {node.op_type} of the width it reads, {k} -> {n}")
    if node.op_type in FEATURE_OPS:
        return ClassGuess(name, False, True, f"a {node.op_type} makes it")
    return ClassGuess(name, False, False, f"a {node.op_type} makes it")


def _widths(node: onnx.NodeProto, index: GraphIndex) -> tuple[int, int] | None:
    """(in, out) features of a MatMul or Gemm whose weight is a constant, None where it is not."""
    name = node.input[1] if len(node.input) > 1 else ""
    dq = index.producer.get(name)
    if dq is not None and dq.op_type == "DequantizeLinear":  # a quantized weight: its stored tensor
        name = dq.input[0]
    weight = index.inits.get(name)
    if weight is None or len(weight.dims) < 2:
        return None
    k, n = int(weight.dims[-2]), int(weight.dims[-1])
    if node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute):
        k, n = n, k
    return k, n


__all__ = ["ClassGuess", "guess_class_output"]
