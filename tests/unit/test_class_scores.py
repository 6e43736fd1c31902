"""The class-score guess tells logits from features: an encoder's hidden states and pooled output are
judged by SNR (never by an argmax over hidden features), a classifier head's logits by agreement."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.accuracy.class_scores import guess_class_output
from pipeline.accuracy.holdout import class_outputs
from pipeline.accuracy.metrics import ModelScores
from tests.helpers import compose

HIDDEN, SEQ = 32, 8


def _encoder(first: str, head: int | None = None, name: str | None = None):
    """x [1, SEQ, HIDDEN] -> MatMul -> Add(bias) -> Add(residual) -> LayerNormalization = hidden states;
    the first output is ``first``: "hidden", "pooler" (Tanh of a projection of the first token), "head"
    (a MatMul HIDDEN -> ``head`` + bias on the hidden states) or "softmax" (of the head)."""
    rng = np.random.default_rng(0)
    w = lambda n, k, m: numpy_helper.from_array(rng.standard_normal((k, m)).astype(np.float32), n)  # noqa: E731
    inits = [w("w1", HIDDEN, HIDDEN), numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "b1"),
             numpy_helper.from_array(np.ones(HIDDEN, np.float32), "g"),
             numpy_helper.from_array(np.zeros(HIDDEN, np.float32), "beta"), w("wp", HIDDEN, HIDDEN)]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m"]), helper.make_node("Add", ["m", "b1"], ["mb"]),
             helper.make_node("Add", ["mb", "x"], ["res"]),
             helper.make_node("LayerNormalization", ["res", "g", "beta"], ["hidden"], axis=-1)]
    out = "hidden"
    if first == "pooler":
        nodes += [helper.make_node("MatMul", ["hidden", "wp"], ["pm"]), helper.make_node("Tanh", ["pm"], ["pooled"])]
        out = "pooled"
    elif first in ("head", "softmax", "square"):
        width = head or HIDDEN
        inits += [w("wh", HIDDEN, width), numpy_helper.from_array(np.zeros(width, np.float32), "bh")]
        nodes += [helper.make_node("MatMul", ["hidden", "wh"], ["hm"]), helper.make_node("Add", ["hm", "bh"], ["head"])]
        out = "head"
        if first == "softmax":
            nodes.append(helper.make_node("Softmax", ["head"], ["probs"], axis=-1))
            out = "probs"
    if name is not None:
        nodes.append(helper.make_node("Identity", [out], [name]))
        out = name
    graph = helper.make_graph(nodes, "encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, HIDDEN])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("first, head, name, classes", [
    ("hidden", None, "output", False),            # LayerNormalization: hidden states
    ("hidden", None, "last_hidden_state", False),
    ("pooler", None, "output", False),            # Tanh: a pooled representation
    ("pooler", None, "pooler_output", False),
    ("head", 5, "output", True),                   # a classifier head: HIDDEN -> 5
    ("softmax", 5, "output", True),
    ("head", 5, "sentence_embedding", False),      # the name says features
    ("hidden", None, "logits", True),              # ... or class scores
])
def test_the_guess_reads_the_name_and_the_op_that_makes_the_output(first, head, name, classes):
    guess = guess_class_output(_encoder(first, head, name))
    assert guess.output == name and guess.classes is classes, guess


def test_a_projection_of_the_width_it_reads_is_unsure_and_says_which_key_changes_it():
    guess = guess_class_output(_encoder("square", None, "output"))  # HIDDEN -> HIDDEN: a projection
    assert not guess.classes and not guess.sure
    assert "accuracy.class_outputs=[output]" in guess.line() and "not clearly class scores" in guess.line()


def test_hidden_states_are_never_judged_by_argmax_agreement_unless_the_config_says_so(caplog):
    cfg = compose([])
    encoder = _encoder("hidden", None, "last_hidden_state")
    with caplog.at_level(logging.INFO, logger="tune.accuracy"):
        classes = class_outputs(cfg, encoder)
    assert classes == [] and any("judged by SNR" in r.getMessage() for r in caplog.records)
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((4, SEQ, HIDDEN)).astype(np.float32)
    scores = ModelScores(output_names=["last_hidden_state"], class_outputs=classes)
    scores.update([ref], [ref + 0.3 * rng.standard_normal(ref.shape).astype(np.float32)], None, 4)
    assert scores.scores().agreement is None  # no argmax over hidden features
    assert class_outputs(compose(["accuracy.class_outputs=[last_hidden_state]"]), encoder) == ["last_hidden_state"]
    assert class_outputs(cfg, _encoder("head", 5, "output")) == ["output"]
