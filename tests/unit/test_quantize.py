"""Calibration statistics, Q/DQ insertion and the default placements (checked on ORT's optimized graph)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from pipeline.calibrate.collect import CalibrationMethod, collect
from pipeline.data.adapters import Batch
from pipeline.quant.calibration import Calibration
from pipeline.quant.placement import onnxruntime_plan, resolve_rules, tensorrt_plan
from pipeline.quant.qdq import apply_plan, get_quantized_tensors
from pipeline.quant.qmath import QTYPES
from tests import models

INT8 = [{"module_name": "*", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}}]
FP8 = [{"module_name": "*", "weights": {"dtype": "fp8_e4m3fn"}, "activations": {"dtype": "fp8_e4m3fn"}}]


def _batches(model, n=4, seed=0):
    from pipeline.graph.model import input_specs

    spec = input_specs(model)[0]
    rng = np.random.default_rng(seed)
    return lambda: (Batch({spec.name: rng.standard_normal(spec.shape).astype(np.float32)}, None, spec.shape[0])
                    for _ in range(n))


def _calibrate(model, algorithm="minmax"):
    stats = collect(model, _batches(model), CalibrationMethod(algorithm, 99.9, 2048), 1, lambda it, desc: it)
    return Calibration(stats)


def _ort_ops(model: onnx.ModelProto, tmp_path) -> Counter:
    path = tmp_path / "opt.onnx"
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(path)
    so.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _run(model, feeds):
    from pipeline.backends.onnxruntime.session import disable_qdq_fusion_if_fp8

    so = ort.SessionOptions()
    disable_qdq_fusion_if_fp8(so, model)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _check_qdq_invariants(model: onnx.ModelProto) -> None:
    inits = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(n.input) < 3:
            continue
        zp = inits[n.input[2]]
        scale = inits[n.input[1]]
        if n.op_type == "QuantizeLinear" or zp.data_type != TensorProto.INT32:
            assert zp.data_type in {v[0] for v in QTYPES.values()}
        if n.op_type == "DequantizeLinear" and n.input[0] in inits:
            # stored weights: same dtype as their zero point
            assert inits[n.input[0]].data_type == zp.data_type
        if not any(a.name == "axis" for a in n.attribute):
            assert list(scale.dims) == [] and list(zp.dims) == [], n.name


def test_ort_placement_fuses_into_integer_kernels(tmp_path):
    model = models.residual_block()
    rules = resolve_rules(model, INT8)
    q = apply_plan(model, onnxruntime_plan(model, rules, "uint8"), _calibrate(model))
    _check_qdq_invariants(q)
    ops = _ort_ops(q, tmp_path)
    assert ops["QLinearConv"] == 5 and ops["QLinearAdd"] == 2 and ops["QLinearGlobalAveragePool"] == 1
    assert ops["QGemm"] == 1 and ops.get("Conv", 0) == 0 and ops.get("FusedConv", 0) == 0
    x = np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)
    ref, got = _run(model, {"input": x})[0], _run(q, {"input": x})[0]
    assert np.corrcoef(ref.ravel(), got.ravel())[0, 1] > 0.99


def test_ort_placement_attention(tmp_path):
    model = models.attention_block()
    q = apply_plan(model, onnxruntime_plan(model, resolve_rules(model, INT8), "uint8"), _calibrate(model))
    _check_qdq_invariants(q)
    ops = _ort_ops(q, tmp_path)
    integer = ops["QLinearMatMul"] + ops["MatMulIntegerToFloat"] + ops["QGemm"]
    assert integer >= 5 and ops.get("MatMul", 0) == 0
    assert "Softmax" in ops and "QLinearSoftmax" not in ops  # softmax stays float
    x = np.random.default_rng(1).standard_normal((2, 16, 32)).astype(np.float32)
    ref, got = _run(model, {"input": x})[0], _run(q, {"input": x})[0]
    assert np.corrcoef(ref.ravel(), got.ravel())[0, 1] > 0.99


def test_tensorrt_placement_follows_recommendations():
    model = models.residual_block()
    plan = tensorrt_plan(model, resolve_rules(model, INT8))
    q = apply_plan(model, plan, _calibrate(model))
    _check_qdq_invariants(q)
    quantized = get_quantized_tensors(q)
    # inputs of every conv are quantized, outputs of weighted ops are not
    assert {"input", "h0", "block0_r1", "h1", "block1_r1"} <= quantized
    assert not {"s", "block0_c2", "block1_c2"} & quantized
    # residual Add: the skip input (h0/h1) feeds the Add through a DQ, the conv branch stays float
    adds = {n.name: list(n.input) for n in q.graph.node if n.op_type == "Add"}
    assert adds["block0/add"][0] == "block0_c2" and adds["block0/add"][1].endswith("_dequantized")
    # weights per output channel, symmetric int8
    for n in q.graph.node:
        if n.op_type == "DequantizeLinear" and "_w" in n.input[0]:
            assert any(a.name == "axis" and a.i == 0 for a in n.attribute)
    # the fc Gemm has N = 10 < 16: left float like the reference tool does
    assert "flat" not in quantized


def test_fp8_raises_opset_and_runs():
    model = models.conv_chain(channels=16)
    q = apply_plan(model, tensorrt_plan(model, resolve_rules(model, FP8)), _calibrate(model, "max"))
    assert q.opset_import[0].version >= 19
    fp8 = {TensorProto.FLOAT8E4M3FN}
    zps = [i for i in q.graph.initializer if i.name.endswith("zero_point")]
    assert zps and all(z.data_type in fp8 for z in zps)
    x = np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)
    ref, got = _run(model, {"input": x})[0], _run(q, {"input": x})[0]
    assert np.corrcoef(ref.ravel(), got.ravel())[0, 1] > 0.99


def test_small_ops_stay_float_for_fp8_only():
    model = models.conv_chain(channels=8)  # N = 8 output channels
    fp8 = tensorrt_plan(model, resolve_rules(model, FP8))
    assert {"conv1", "conv2"} <= set(fp8.skipped) and not fp8.node_rules
    int8 = tensorrt_plan(model, resolve_rules(model, INT8))
    assert {"conv1", "conv2"} <= set(int8.node_rules) and "fc" in int8.skipped  # Gemm N = 10


@pytest.mark.parametrize("placement", ["tensorrt", "onnxruntime"])
def test_mixed_precision_rules_apply_per_node(placement):
    model = models.attention_block()
    rules_cfg = [
        {"module_name": "attn/*", "weights": {"dtype": "fp8_e4m3fn"}, "activations": {"dtype": "fp8_e4m3fn"}},
        {"module_name": "MatMul", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}},
    ]
    rules = resolve_rules(model, rules_cfg, skip_names=["ffn/fc2"])
    assert "ffn/fc2" not in rules and rules["attn/q"].activations == "fp8_e4m3fn"
    assert rules["ffn/fc1"].rule.startswith("layers[1]")
    plan = (tensorrt_plan(model, rules) if placement == "tensorrt"
            else onnxruntime_plan(model, rules, "int8"))
    q = apply_plan(model, plan, _calibrate(model, "max"))
    inits = {i.name: i for i in q.graph.initializer}
    producers = {o: n for n in q.graph.node for o in n.output}
    want = {"fp8": TensorProto.FLOAT8E4M3FN, "int8": TensorProto.INT8}
    checked = 0
    for node in q.graph.node:
        if node.op_type != "MatMul":
            continue
        for t in node.input:
            dq = producers.get(t)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            dtype = inits[dq.input[2]].data_type
            expected = want["fp8"] if node.name.startswith("attn/") else want["int8"]
            assert dtype == expected, (node.name, t, dtype)
            checked += 1
        if node.name == "ffn/fc2":
            assert all(producers.get(t) is None or producers[t].op_type != "DequantizeLinear"
                       or producers[t].input[0] not in inits for t in node.input[1:])
    assert checked >= 6
    types = {i.data_type for i in inits.values()}
    assert TensorProto.FLOAT8E4M3FN in types and TensorProto.INT8 in types
    _run(q, {"input": np.zeros((2, 16, 32), np.float32)})


def _outlier_model():
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [4, 256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 256])
    g = helper.make_graph([helper.make_node("Identity", ["input"], ["y"], name="id")], "o", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_entropy_and_percentile_clip_outliers_max_keeps_them():
    model = _outlier_model()
    rng = np.random.default_rng(0)

    def batches():
        r = np.random.default_rng(0)
        for k in range(16):
            a = r.standard_normal((4, 256)).astype(np.float32)
            if k % 2 == 0:
                a.ravel()[r.integers(0, a.size)] = 60.0  # one value in 2048 (0.05%) at 60 sigma
            yield Batch({"input": a}, None, 4)

    res = {alg: collect(model, batches,
                        CalibrationMethod(alg, 99.9, 2048), 1, lambda it, d: it)["y"].threshold
           for alg in ("minmax", "max", "entropy", "percentile")}
    assert res["max"] == pytest.approx(60.0) and res["minmax"] == pytest.approx(60.0)
    assert res["entropy"] < 0.25 * res["max"], res
    assert res["percentile"] < 0.25 * res["max"], res
    del rng


def test_calibration_ignores_padding():
    model = _outlier_model()

    def batches():
        a = np.zeros((4, 256), np.float32)
        a[:2] = 1.0
        a[2:] = 100.0  # padding rows: must not count
        yield Batch({"input": a}, None, 2)

    s = collect(model, batches, CalibrationMethod("minmax", 99.9, 2048), 1, lambda it, d: it)["y"]
    assert s.max == 1.0 and s.samples == 2


def test_a_qdq_for_every_reader_leaves_float_a_reader_that_only_carries_it_to_graph_outputs():
    """A recurrent state: the tensor a MatMul reads is also passed, unchanged (Identity, Unsqueeze), to a graph
    output that comes back as the next call's state. A Q/DQ on it for every reader rewires the MatMul only;
    the state keeps its float values, which a Q/DQ would round on every call. A reader that computes past a
    move-only op is rewired."""
    from pipeline.quant.plan import ActivationQ, QDQPlan

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel().tolist())
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="act"),
             helper.make_node("MatMul", ["h", "w"], ["y"], name="mm"),
             helper.make_node("Identity", ["h"], ["h_id"], name="carry"),
             helper.make_node("Unsqueeze", ["h_id", "axes"], ["state"], name="stack"),
             helper.make_node("Reshape", ["h", "shape"], ["h2"], name="move"),
             helper.make_node("Mul", ["h2", "h2"], ["sq"], name="square")]
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [1, 4])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "state", "sq")]
    model = onnx.shape_inference.infer_shapes(helper.make_model(
        helper.make_graph(nodes, "g", [x], outs, [w, axes, shape]), opset_imports=[helper.make_opsetid("", 17)]))
    q = apply_plan(model, QDQPlan(activations=[ActivationQ("h", "uint8")]), _calibrate(model))
    readers = {n.name: list(n.input) for n in q.graph.node}
    dq = next(n.output[0] for n in q.graph.node if n.op_type == "DequantizeLinear")
    assert readers["mm"][0] == dq and readers["move"][0] == dq  # compute, directly or past a Reshape
    assert readers["carry"][0] == "h"  # the state: float
