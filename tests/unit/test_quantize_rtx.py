"""Every Q/DQ model the quantize code emits (int8, fp8, mixed; both placements) parses and builds as a
TensorRT engine with the TensorRT-RTX builder, which runs on this CPU-only machine."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from pipeline.calibrate.collect import CalibrationMethod, collect
from pipeline.data.adapters import Batch
from pipeline.graph.model import input_specs
from pipeline.quant.calibration import Calibration
from pipeline.quant.placement import onnxruntime_plan, resolve_rules, tensorrt_plan
from pipeline.quant.qdq import apply_plan
from tests import models
from tests.helpers import compose

pytestmark = pytest.mark.rtx

RULES = {
    "int8": [{"module_name": "*", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}}],
    "fp8": [{"module_name": "*", "weights": {"dtype": "fp8_e4m3fn"}, "activations": {"dtype": "fp8_e4m3fn"}}],
    "mixed": [
        {"module_name": "Conv", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}},
        {"module_name": "MatMul", "weights": {"dtype": "fp8_e4m3fn"}, "activations": {"dtype": "fp8_e4m3fn"}},
        {"module_name": "Gemm", "weights": {"dtype": "fp8_e4m3fn"}, "activations": {"dtype": "fp8_e4m3fn"}},
    ],
}


@pytest.fixture(scope="module")
def rtx():
    import importlib.util

    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX bindings missing: pip install 'qdq-tune[rtx]'")
    from pipeline.backends import create_backend

    return create_backend(compose(["backend=tensorrt_rtx"]).backend)


def _calibration(model: onnx.ModelProto) -> Calibration:
    spec = input_specs(model)[0]
    rng = np.random.default_rng(0)

    def batches():
        for _ in range(3):
            yield Batch({spec.name: rng.standard_normal(spec.shape).astype(np.float32)}, None, spec.shape[0])

    return Calibration(collect(model, batches, CalibrationMethod("max", 99.9, 2048), 1, lambda it, d: it))


@pytest.mark.parametrize("builder", ["conv_chain", "residual_block", "attention_block"])
@pytest.mark.parametrize("kind", ["int8", "fp8", "mixed"])
@pytest.mark.parametrize("placement", ["tensorrt", "onnxruntime"])
def test_quantized_models_build_with_tensorrt_rtx(rtx, tmp_path, builder, kind, placement):
    model = getattr(models, builder)(channels=16) if builder != "attention_block" else models.attention_block()
    rules = resolve_rules(model, RULES[kind])
    plan = tensorrt_plan(model, rules) if placement == "tensorrt" else onnxruntime_plan(model, rules, "int8")
    if not plan.activations:
        pytest.skip("rules quantize nothing in this model")
    q = apply_plan(model, plan, _calibration(model))
    path = tmp_path / "q.onnx"
    onnx.save(q, str(path))
    res = rtx.build(path, tmp_path / "q.engine", tmp_path / "build.log")
    assert res.engine_path.stat().st_size > 0 and (tmp_path / "build.log").exists()


@pytest.mark.parametrize("builder", ["scan_rnn", "loop_rnn", "nested"])
@pytest.mark.parametrize("placement", ["tensorrt", "onnxruntime"])
def test_models_quantized_inside_loop_and_scan_bodies_build_with_tensorrt_rtx(rtx, tmp_path, builder, placement):
    """Q/DQ inside the bodies, with ORT's uint8 activations and int32 biases rewritten there too."""
    model = models.scan_rnn(inner_steps=2) if builder == "nested" else getattr(models, builder)()
    rules = resolve_rules(model, RULES["int8"])
    plan = tensorrt_plan(model, rules) if placement == "tensorrt" else onnxruntime_plan(model, rules, "uint8")
    assert plan.bodies
    path = tmp_path / "q.onnx"
    onnx.save(apply_plan(model, plan, _calibration(model)), str(path))
    res = rtx.build(path, tmp_path / "q.engine", tmp_path / "build.log")
    assert res.engine_path.stat().st_size > 0
