"""Quantization inside Loop/Scan bodies: ranges calibrated from inside the body, Q/DQ placed in the body by
the main graph's rules, names unique across the model, and the body placement autotune keeps."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from pipeline.backends.onnxruntime.session import inference_session
from pipeline.calibrate.collect import CalibrationMethod, collect
from pipeline.data.adapters import Batch
from pipeline.graph.bodies import body, thread_out, unique_names
from pipeline.graph.model import input_specs, iter_nodes
from pipeline.quant.calibration import Calibration, load_calibration
from pipeline.quant.cpu import cpu_facts
from pipeline.quant.placement import onnxruntime_plan, resolve_rules, tensorrt_plan
from pipeline.quant.qdq import apply_plan
from tasks.autotune.region.autotuner import Config, QDQAutotuner
from tests import models
from tests.helpers import body_matmuls

INT8 = [{"module_name": "*", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}}]
BUILDERS = {"scan": models.scan_rnn, "loop": models.loop_rnn, "nested": lambda: models.scan_rnn(inner_steps=2)}


def _feeds(model: onnx.ModelProto, n: int = 4, seed: int = 0) -> list[dict[str, np.ndarray]]:
    spec = input_specs(model)[0]
    rng = np.random.default_rng(seed)
    return [{spec.name: rng.standard_normal(spec.shape).astype(np.float32)} for _ in range(n)]


def _stats(model: onnx.ModelProto, algorithm: str = "minmax") -> dict[str, dict]:
    feeds = _feeds(model)
    rows = next(iter(feeds[0].values())).shape[0]
    return collect(model, lambda: (Batch(f, None, rows) for f in feeds),
                   CalibrationMethod(algorithm, 99.9, 2048), 1, lambda it, d: it)


# ONNX Runtime's u8 x s8 kernels saturate on this CPU (AVX2 without VNNI): the weight storage the quantize
# stage picks here is uint8, and TensorRT placements are judged as plain Q/DQ math, as the stage does
SATURATES = bool(cpu_facts().u8s8_saturates)


def _plan(model: onnx.ModelProto, placement: str):
    rules = resolve_rules(model, INT8)
    if placement == "tensorrt":
        return tensorrt_plan(model, rules)
    return onnxruntime_plan(model, rules, "uint8", weight_range="uint8" if SATURATES else "full")


def _snr_db(model: onnx.ModelProto, quantized: onnx.ModelProto, placement: str = "onnxruntime") -> float:
    """Output SNR of ``quantized`` vs ``model`` on ONNX Runtime: its fused kernels for an ORT placement;
    for a TensorRT placement too, except where they saturate (TensorRT's integer kernels do not)."""
    options = None
    if placement == "tensorrt" and SATURATES:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    a_sess, b_sess = inference_session(model), inference_session(quantized, options)
    sig = err = 0.0
    for feed in _feeds(model, seed=1):
        a, b = a_sess.run(None, feed)[0], b_sess.run(None, feed)[0]
        sig += float(np.sum(a.astype(np.float64) ** 2))
        err += float(np.sum((a.astype(np.float64) - b) ** 2))
    return 10 * np.log10(sig / err)


@pytest.mark.parametrize("placement", ["onnxruntime", "tensorrt"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_body_matmuls_read_dequantized_inputs_and_stay_close_to_float(name, placement):
    model = BUILDERS[name]()
    stats = _stats(model)
    plan = _plan(model, placement)
    matmuls = body_matmuls(model)
    assert len(matmuls) == 2 and set(matmuls) <= set(plan.quantized_nodes())
    assert len(plan.bodies) == 1
    q = apply_plan(model, plan, Calibration(stats))  # passes onnx.checker
    assert body_matmuls(q) == {n: ["DequantizeLinear", "DequantizeLinear"] for n in matmuls}
    assert _snr_db(model, q, placement) >= 25.0


def test_scan_body_ranges_are_those_of_the_tensors_inside_the_body():
    model = models.scan_rnn()
    feeds = _feeds(model)
    stats = _stats(model)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in [*model.graph.initializer,
                                                            *body(model.graph.node[1]).initializer]}
    xw, hr = [], []
    for feed in feeds:  # the cell in numpy, step by step
        h = np.zeros((2, 32), np.float32)
        for x_t in feed["input"].transpose(1, 0, 2):
            xw.append(x_t @ inits["W"])
            hr.append(h @ inits["rnn/R"])
            h = np.tanh(xw[-1] + hr[-1] + inits["rnn/b"])
    for name, values in (("rnn/xw", xw), ("rnn/hr", hr)):
        s = stats[name]
        assert np.isclose(s.min, np.min(values), atol=1e-5) and np.isclose(s.max, np.max(values), atol=1e-5)
        assert s.samples == 8  # 4 batches of 2
    assert "W" not in stats and "rnn/R" not in stats


def test_tensors_of_nested_bodies_are_stacked_over_every_enclosing_loop():
    model = models.scan_rnn(inner_steps=3)
    threaded, found = thread_out(model, ["rnn/inner/xw", "rnn/h_new", "logits"])
    assert set(found) == {"rnn/inner/xw", "rnn/h_new"}  # main-graph tensors are read as they are
    assert found["rnn/inner/xw"][1] == 2 and found["rnn/h_new"][1] == 1
    outs = inference_session(threaded).run([found["rnn/inner/xw"][0], found["rnn/h_new"][0]], _feeds(model, 1)[0])
    assert outs[0].shape == (6, 3, 2, 32) and outs[1].shape == (6, 2, 32)


def test_sibling_bodies_with_the_same_names_are_renamed_apart():
    """Two Scans exported from the same layer code share every name inside their bodies."""
    model = models.scan_rnn()
    g = model.graph
    twin = onnx.NodeProto()
    twin.CopyFrom(g.node[1])
    twin.name, twin.output[:] = "rnn2/Scan", ["h_last2", "hs2"]
    body(g.node[1]).node[0].name = ""  # an exporter may leave body nodes unnamed
    g.node.insert(2, twin)
    g.node.insert(3, helper.make_node("Add", ["h_last", "h_last2"], ["h_sum"], name="merge"))
    next(n for n in g.node if n.name == "head/MatMul").input[0] = "h_sum"
    del g.value_info[:]
    model = onnx.shape_inference.infer_shapes(model)
    feed = _feeds(model, 1)[0]
    before = inference_session(model).run(None, feed)[0]
    assert unique_names(model) > 0
    onnx.checker.check_model(model, full_check=True)
    names = [n.name for n in iter_nodes(model.graph)]
    values = [o for n in iter_nodes(model.graph) for o in n.output]
    assert "" not in names and len(set(names)) == len(names) and len(set(values)) == len(values)
    np.testing.assert_array_equal(inference_session(model).run(None, feed)[0], before)
    plan = _plan(model, "onnxruntime")
    assert set(plan.bodies) == {"rnn/Scan", "rnn2/Scan"}
    assert len(body_matmuls(apply_plan(model, plan, Calibration(_stats(model))))) == 4


def test_autotune_models_keep_the_body_placement_of_calibration_json(tmp_path):
    """autotune tunes the main graph; its plans carry no bodies, so apply_plan takes calibration.json's."""
    model = models.loop_rnn()
    stats = _stats(model)
    plan = _plan(model, "onnxruntime")
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"tensors": {t: v.to_dict() for t, v in stats.items()}, "bodies": {k: p.to_dict() for k, p in plan.bodies.items()}}))
    calibration = load_calibration(path)
    assert {k: p.to_dict() for k, p in calibration.bodies.items()} == {k: p.to_dict() for k, p in plan.bodies.items()}
    tuner = QDQAutotuner(model)
    tuner.initialize(Config(placement="onnxruntime", activation_type="uint8",
                            weight_range="uint8" if SATURATES else "full"), calibration=calibration)
    for assignment in ({}, None):  # no Q/DQ in the main graph, and the search's current placement
        q = tuner.export_model(assignment=assignment)
        assert list(body_matmuls(q).values()) == [["DequantizeLinear", "DequantizeLinear"]] * 2
        assert _snr_db(model, q) >= 25.0
