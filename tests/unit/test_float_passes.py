"""The float-exact transforms are passes: one class each, composed in one list, every rewrite held to the
float-exact rule (a postcondition) and recorded in one typed TransformRecord."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
from omegaconf import OmegaConf
from onnx import numpy_helper

from pipeline.records.quantize import BiasCorrection
from pipeline.transforms.record import TransformRecord
from tasks.quantize.passes.sequence import FLOAT_PASSES, FloatPass, PassContext, run_passes, summary
from tests import models


class ScaleFirstConv(FloatPass):
    """Doubles conv1's weights and bias: the float outputs change."""

    name, config_key = "scale_first_conv", "scale_first_conv"

    def rewrite(self, model, ctx):
        new = onnx.ModelProto()
        new.CopyFrom(model)
        for init in new.graph.initializer:
            if init.name in ("w1", "b1"):
                init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 2, init.name))
        return new, [{"node": "conv1"}]


class RenameNodes(FloatPass):
    """Renames every node: float-exact."""

    name, config_key = "rename_nodes", "rename_nodes"

    def rewrite(self, model, ctx):
        new = onnx.ModelProto()
        new.CopyFrom(model)
        for n in new.graph.node:
            n.name = f"renamed/{n.name}"
        return new, [{"nodes": len(new.graph.node)}]

    def phrase(self, record):
        return f"renamed {record.changes[0]['nodes']} nodes"


class NeedsAnLstm(FloatPass):
    name, config_key = "needs_an_lstm", "needs_an_lstm"

    def precondition(self, model):
        return None if any(n.op_type == "LSTM" for n in model.graph.node) else "no LSTM"

    def rewrite(self, model, ctx):
        raise AssertionError("a pass whose precondition fails is not run")


def _ctx(**on: bool) -> PassContext:
    rng = np.random.default_rng(0)
    batches = [SimpleNamespace(feeds={"input": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)})
               for _ in range(6)]
    return PassContext(OmegaConf.create(on), lambda: iter(batches), 1, "uint8")


def test_a_pass_is_one_class_held_to_the_float_exact_rule_and_recorded():
    model = models.conv_chain()
    passes = [ScaleFirstConv(), RenameNodes(), NeedsAnLstm()]
    out, records = run_passes(model, passes, _ctx(scale_first_conv=True, rename_nodes=True, needs_an_lstm=True))
    scaled, renamed, lstm = records
    assert not scaled.applied and scaled.reason.startswith("float outputs changed by") and scaled.float_rel_error > 1e-5
    assert renamed.applied and renamed.float_rel_error <= 1e-5 and renamed.reason is None
    assert (lstm.applied, lstm.reason, lstm.changes) == (False, "no LSTM", [])
    # the rejected rewrite left the model as it was; the kept one is the model returned
    assert all(n.name.startswith("renamed/") for n in out.graph.node)
    assert numpy_helper.to_array(out.graph.initializer[0]).tolist() == numpy_helper.to_array(
        model.graph.initializer[0]).tolist()
    assert all(not n.name.startswith("renamed/") for n in model.graph.node)  # the input is never mutated
    assert summary(records, None) == []  # only the built-in passes have phrases in reports
    # a pass the config leaves off leaves no record
    assert [r.transform for r in run_passes(model, passes, _ctx(rename_nodes=True))[1]] == ["rename_nodes"]


def test_the_built_in_passes_and_their_records_keep_calibration_jsons_layout():
    assert [p.name for p in FLOAT_PASSES] == ["fold_scales", "equalization", "smoothing"]
    model = models.conv_chain()
    _, records = run_passes(model, FLOAT_PASSES, _ctx(fold_scales=True, equalization=True, smoothing=True))
    fold, eq, smooth = records
    assert (fold.applied, fold.reason) == (False, "nothing to change")
    assert eq.applied and len(eq.changes) == 1 and eq.float_rel_error <= 1e-5
    assert smooth.reason == "no MatMul/Gemm with a constant weight reads an activation"
    bias = BiasCorrection(True, 2)
    assert summary(records, bias) == ["equalized 1 conv pair(s)", "bias-corrected 2 node(s)"]
    doc = eq.to_dict()
    assert list(doc) == ["transform", "applied", "float_rel_error", "changes"]
    assert TransformRecord.from_dict(doc) == eq
    assert fold.to_dict() == {"transform": "fold_scales", "applied": False, "reason": "nothing to change", "changes": []}
