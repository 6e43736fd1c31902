"""Bias correction: the mean output shift that quantization adds to each quantized conv/matmul is
measured on calibration data and absorbed by its bias; apply_plan applies it only to the nodes a plan
quantizes, so autotune's placements get it too."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from pipeline.calibrate.collect import CalibrationMethod, collect
from pipeline.data.adapters import Batch, synthetic_batches
from pipeline.graph.model import input_specs
from pipeline.quant.calibration import Calibration
from pipeline.quant.placement import onnxruntime_plan, resolve_rules
from pipeline.quant.qdq import apply_plan
from tasks.quantize.bias_correction import bias_slots, corrections, mean_shifts
from tests import models


def _setup():
    model = models.conv_chain(batch=4)
    feeds = [f for f, _ in synthetic_batches(input_specs(model), 48, 0)]
    stats = collect(model, lambda: iter([Batch(f, None, 4) for f in feeds[:8]]),
                    CalibrationMethod("minmax", 99.99, 2048), 1, lambda it, desc: it)
    rules = resolve_rules(model, [{"module_name": "*", "weights": {"dtype": "int8"},
                                   "activations": {"dtype": "int8"}}])
    return model, feeds, stats, rules


def _shift(model, qmodel, feeds, nodes):
    slots, _, _ = bias_slots(model, nodes)
    shifts = mean_shifts(model, qmodel, feeds, slots)
    return {n: float(np.mean(np.abs(v["shift"])) / v["rms"]) for n, v in shifts.items()}


def test_bias_correction_reduces_the_mean_output_shift():
    model, feeds, stats, rules = _setup()
    # 7-bit weights: a coarse grid whose rounding shifts the channel means visibly
    plan = onnxruntime_plan(model, rules, "uint8", weight_range="reduced")
    quantized = {w.node for w in plan.weights}
    qmodel = apply_plan(model, plan, Calibration(stats))
    corr, records = corrections(model, lambda c: apply_plan(model, plan, Calibration(stats, bias_corrections=c)),
                                feeds[:8], quantized)
    assert set(corr) == {r["bias"] for r in records if r.get("bias")} and len(corr) == len(quantized)
    corrected = apply_plan(model, plan, Calibration(stats, bias_corrections=corr))
    held_out = feeds[8:]
    before = _shift(model, qmodel, held_out, quantized)
    after = _shift(model, corrected, held_out, quantized)
    assert sum(after.values()) < 0.6 * sum(before.values()), (before, after)
    # the node with the largest shift loses most of it, measured on batches it was not corrected on
    worst = max(before, key=before.get)
    assert after[worst] < 0.5 * before[worst], (before, after)
    assert all(r["mean_abs_shift_rel_after"] < r["mean_abs_shift_rel"] for r in records if r.get("bias"))


def test_corrections_apply_only_to_the_nodes_a_plan_quantizes():
    model, feeds, stats, rules = _setup()
    plan = onnxruntime_plan(model, rules, "uint8")
    corr, _ = corrections(model, lambda c: apply_plan(model, plan, Calibration(stats, bias_corrections=c)),
                          feeds[:4], {w.node for w in plan.weights})
    bias_of = {n.name: n.input[2] for n in model.graph.node if n.op_type == "Conv"}
    kept = {k: v for k, v in rules.items() if k != "conv2"}
    partial = apply_plan(model, onnxruntime_plan(model, kept, "uint8"), Calibration(stats, bias_corrections=corr))
    inits = {i.name: numpy_helper.to_array(i) for i in partial.graph.initializer}
    orig = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert np.array_equal(inits[bias_of["conv2"]], orig[bias_of["conv2"]])  # float node: untouched
    # conv1's bias feeds a quantized conv: corrected (stored int32 for ORT's QLinearConv, or float)
    c1 = bias_of["conv1"]
    if c1 in inits:
        assert not np.array_equal(inits[c1], orig[c1])


def test_a_bias_the_exporter_shared_between_nodes_is_left_as_it_is():
    """torch merges equal initializers: BERT's zero attention biases became one tensor with a LayerNorm's
    beta. Correcting each node into the shared tensor moved every other one (BERT-base: -2.6 dB)."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    w1, w2 = (numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), n) for n in ("w1", "w2"))
    w3 = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w3")
    zero, own = (numpy_helper.from_array(np.zeros(16, np.float32), n) for n in ("zero", "own"))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"), helper.make_node("Add", ["m1", "zero"], ["a1"], name="b1"),
             helper.make_node("MatMul", ["a1", "w2"], ["m2"], name="mm2"), helper.make_node("Add", ["m2", "zero"], ["a2"], name="b2"),
             helper.make_node("MatMul", ["a2", "w3"], ["m3"], name="mm3"), helper.make_node("Add", ["m3", "own"], ["y"], name="b3")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], [w1, w2, w3, zero, own])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    slots, missing, shared = bias_slots(model, ["mm1", "mm2", "mm3"])
    assert [s.node for s in slots] == ["mm3"] and not missing and sorted(s.node for s in shared) == ["mm1", "mm2"]
    feeds = [f for f, _ in synthetic_batches(input_specs(model), 16, 0)]
    stats = collect(model, lambda: iter([Batch(f, None, 4) for f in feeds]),
                    CalibrationMethod("minmax", 99.99, 2048), 1, lambda it, d: it)
    rules = resolve_rules(model, [{"module_name": "*", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}}])
    plan = onnxruntime_plan(model, rules, "uint8", weight_range="reduced")
    corr, records = corrections(model, lambda c: apply_plan(model, plan, Calibration(stats, bias_corrections=c)),
                                feeds, {"mm1", "mm2", "mm3"})
    assert set(corr) == {"own"}
    assert sorted(r["node"] for r in records if r.get("skipped") == "bias shared with other nodes") == ["mm1", "mm2"]


def _corrections_both_ways(model, plan, stats, feeds, monkeypatch):
    """corrections() with the biases fed into one placed model, and with every level placed anew."""
    from tasks.quantize import bias_correction

    def build(c):
        return apply_plan(model, plan, Calibration(stats, bias_corrections=c))

    quantized = {w.node for w in plan.weights}
    slots = bias_slots(model, quantized)[0]
    assert bias_correction._FedBiases.of(model, build({}), slots, 1) is not None  # the fed way is taken
    fed = corrections(model, build, feeds, quantized)
    with monkeypatch.context() as m:
        m.setattr(bias_correction._FedBiases, "of", classmethod(lambda cls, *a: None))
        placed = corrections(model, build, feeds, quantized)
    return fed, placed


def test_feeding_the_corrected_biases_computes_what_placing_each_level_does(monkeypatch):
    """int32 biases (ORT's Conv placement) and float biases of MatMul + Add, levels measured on the part of
    the graph above them: the same corrections as placing the model for every level."""
    model, feeds, stats, rules = _setup()
    for plan in (onnxruntime_plan(model, rules, "uint8", weight_range="reduced"),
                 onnxruntime_plan(model, rules, "uint8")):
        assert plan.biases  # int32 biases in the placed model
        (fed, fed_rec), (placed, placed_rec) = _corrections_both_ways(model, plan, stats, feeds[:6], monkeypatch)
        assert fed and set(fed) == set(placed)
        for b in fed:
            np.testing.assert_allclose(fed[b], placed[b], rtol=1e-5, atol=1e-7)
        assert [r["node"] for r in fed_rec] == [r["node"] for r in placed_rec]
        # the shift left after correction: derived from each level's run, measured on the corrected model
        for f, p in zip(fed_rec, placed_rec, strict=True):
            assert f.get("mean_abs_shift_rel_after") == pytest.approx(p.get("mean_abs_shift_rel_after"),
                                                                      rel=1e-3, abs=1e-6)
    layer = models.transformer_layer()
    lfeeds = [f for f, _ in synthetic_batches(input_specs(layer), 6, 0)]
    lstats = collect(layer, lambda: iter([Batch(f, None, 1) for f in lfeeds]),
                     CalibrationMethod("minmax", 99.99, 2048), 1, lambda it, desc: it)
    lrules = resolve_rules(layer, [{"module_name": "*", "weights": {"dtype": "int8"},
                                    "activations": {"dtype": "uint8"}}])
    lplan = onnxruntime_plan(layer, lrules, "uint8")
    (fed, _), (placed, _) = _corrections_both_ways(layer, lplan, lstats, lfeeds, monkeypatch)
    assert fed and set(fed) == set(placed)
    for b in fed:
        np.testing.assert_allclose(fed[b], placed[b], rtol=1e-4, atol=1e-6)


def test_a_bias_listed_as_a_graph_input_too_is_fed_once(monkeypatch):
    """Old exporters list initializers among the graph inputs (overridable values): the fed model keeps the one
    input, and the corrections are those of placing every level."""
    from onnx import helper

    from pipeline.quant.placement import openvino_plan

    layer = models.transformer_layer()
    biases = {s.bias for s in bias_slots(layer, [n.name for n in layer.graph.node])[0]}
    layer.graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                             for i in layer.graph.initializer if i.name in biases)
    feeds = [f for f, _ in synthetic_batches(input_specs(layer), 6, 0)]
    feeds = [{k: v for k, v in f.items() if k not in biases} for f in feeds]
    stats = collect(layer, lambda: iter([Batch(f, None, 1) for f in feeds]),
                    CalibrationMethod("minmax", 99.99, 2048), 1, lambda it, desc: it)
    rules = resolve_rules(layer, [{"module_name": "*", "weights": {"dtype": "int8"},
                                   "activations": {"dtype": "uint8"}}])
    (fed, _), (placed, _) = _corrections_both_ways(layer, openvino_plan(layer, rules), stats, feeds, monkeypatch)
    assert fed and set(fed) == set(placed)
    for b in fed:
        np.testing.assert_allclose(fed[b], placed[b], rtol=1e-5, atol=1e-7)
