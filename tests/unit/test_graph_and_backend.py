from __future__ import annotations

import numpy as np
import onnx
import pytest

from pipeline.backends import compare_interleaved, create_backend
from pipeline.backends.onnxruntime.backend import physical_cores
from pipeline.backends.timing import TimingPlan
from pipeline.errors import InputError
from pipeline.graph.model import dynamic_inputs, fix_input_shapes, input_specs, load_model
from tests import models
from tests.helpers import compose


def test_dynamic_dims_are_fixed_or_rejected_with_hint():
    m = models.with_dynamic_batch(models.conv_chain())
    assert dynamic_inputs(m) == {"input": ["batch", 3, 16, 16]}
    with pytest.raises(InputError, match=r"model.input_shapes='\{input: \[N, 3, 16, 16\]\}'"):
        fix_input_shapes(m, {}, "m.onnx")
    fixed = fix_input_shapes(m, {"input": [4, 3, 16, 16]}, "m.onnx")
    assert input_specs(fixed)[0].shape == (4, 3, 16, 16)
    with pytest.raises(InputError, match="conflicts"):
        fix_input_shapes(models.conv_chain(), {"input": [4, 3, 17, 16]}, "m.onnx")


def test_load_model_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_model(tmp_path / "missing.onnx")
    (tmp_path / "m.txt").write_text("x")
    with pytest.raises(InputError, match="not an ONNX file"):
        load_model(tmp_path / "m.txt")
    (tmp_path / "bad.onnx").write_bytes(b"\x00garbage\xff")
    with pytest.raises(InputError, match="could not be read as ONNX|fails onnx.checker"):
        load_model(tmp_path / "bad.onnx")


def test_ort_backend_measures_and_caches(tiny_models, tmp_path):
    cfg = compose(["backend=onnxruntime", "backend.timing_runs=5", "backend.warmup_runs=1"])
    backend = create_backend(cfg.backend)
    t = backend.measure(tiny_models["conv_chain"])
    assert t.ok and t.n == 5 and t.p10_ms <= t.median_ms <= t.p90_ms
    # same content under another name is not measured again
    copy = tmp_path / "copy.onnx"
    copy.write_bytes(tiny_models["conv_chain"].read_bytes())
    assert backend.measure(copy) is t
    res = backend.build(tiny_models["residual_block"], tmp_path / "opt.onnx", tmp_path / "build.json")
    assert res.engine_path.exists() and "optimized_op_counts" in res.info
    onnx.checker.check_model(onnx.load(str(res.engine_path)))
    outs = backend.run(tiny_models["conv_chain"], {"input": np.zeros((2, 3, 16, 16), np.float32)})
    assert outs[0].shape == (2, 10)


def test_failed_measurement_is_not_infinite(tmp_path):
    cfg = compose(["backend=onnxruntime"])
    backend = create_backend(cfg.backend)
    bad = tmp_path / "bad.onnx"
    m = models.conv_chain()
    m.graph.node[0].op_type = "NoSuchOp"
    onnx.save(m, str(bad))
    t = backend.measure(bad)
    assert not t.ok and t.error and np.isnan(t.median_ms)


def test_interleaved_compare(tiny_models):
    backend = create_backend(compose(["backend=onnxruntime", "backend.timing_runs=6", "backend.warmup_runs=1"]).backend)
    a, b = compare_interleaved(backend, [tiny_models["conv_chain"], tiny_models["attention_block"]],
                               TimingPlan(3, max(1, backend.timing_runs // 3), backend.warmup_runs))
    # 3 rounds of 2 runs at least; more where the faster model needs them to fill a block (MIN_BLOCK_MS)
    assert a.ok and b.ok and a.n == b.n and a.n >= 6 and a.n % 3 == 0
    assert physical_cores() >= 1


def test_unavailable_provider_is_clear():
    from pipeline.errors import BackendUnavailable

    cfg = compose(["backend=onnxruntime", "backend.providers=[CUDAExecutionProvider]"])
    with pytest.raises(BackendUnavailable, match="CUDAExecutionProvider"):
        create_backend(cfg.backend)


def test_batchnorm_folds_into_its_conv_and_outputs_stay_the_same():
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.transforms.folding import fold_batchnorm

    rng = np.random.default_rng(0)
    c = 6
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 8, 8])
    inits = [numpy_helper.from_array(rng.standard_normal((c, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.uniform(0.5, 2, c).astype(np.float32), "g"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "m"),
             numpy_helper.from_array(rng.uniform(0.5, 2, c).astype(np.float32), "v")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["bn"], name="bn", epsilon=1e-3),
             helper.make_node("Relu", ["bn"], ["y"], name="relu")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 11)])
    feeds = {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert fold_batchnorm(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Conv", "Relu"] and len(model.graph.node[0].input) == 3
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5)


def test_external_data_saves_leave_the_callers_model_as_it_was(tmp_path):
    """save_model with external data and inference_session's path for protos past 2 GB stream the weights out
    of the caller's proto one tensor at a time and leave it byte-identical."""
    import numpy as np

    from pipeline.backends.onnxruntime.session import inference_session
    from pipeline.graph.model import model_hash, save_model
    from pipeline.graph.weights import save_external
    from tests import models

    model = models.transformer_layer()
    before = model_hash(model)
    save_model(model, tmp_path / "a.onnx", external_data=True)
    assert (tmp_path / "a.onnx.data").stat().st_size > 10_000 and model_hash(model) == before
    save_external(model, tmp_path / "b.onnx", ["s0"])
    assert model_hash(model) == before and [o.name for o in model.graph.output] == ["output"]
    x = {"input": np.ones((1, 16, 32), np.float32)}
    got = inference_session(tmp_path / "b.onnx").run(["output", "s0"], x)
    want = inference_session(model, extra_outputs=["s0"]).run(["output", "s0"], x)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_node_macs_counts_convs_and_matmuls_from_recorded_shapes():
    from pipeline.graph.shapes import node_macs

    macs = node_macs(models.conv_chain(batch=2, channels=8, size=16, classes=10))
    # conv1: 2x8x16x16 outputs x 3x3x3; conv2: x 8x3x3; the head Gemm (transB): 2x8 inputs x 10 outputs
    assert macs == {"conv1": 2 * 8 * 16 * 16 * 27, "conv2": 2 * 8 * 16 * 16 * 72, "fc": 2 * 8 * 10}
    bert = node_macs(models.attention_block(batch=2, seq=16, hidden=32))
    assert bert and all(v > 0 for v in bert.values())


def test_node_macs_counts_a_dynamic_batch_as_one():
    from pipeline.graph.shapes import node_macs

    fixed = node_macs(models.conv_chain(batch=1))
    dynamic = onnx.shape_inference.infer_shapes(models.with_dynamic_batch(models.conv_chain(batch=1)))
    assert node_macs(dynamic) == fixed  # as export records shapes with a kept dynamic batch


@pytest.mark.parametrize("make", [models.conv_chain, models.transformer_layer, models.dense_2d_bias])
@pytest.mark.parametrize("storage", ["uint8 activations, int8 weights", "uint8 weights", "int8 per tensor"])
def test_a_qdq_model_runs_as_its_math_with_its_constant_dequantizes_computed_once_bit_for_bit(make, storage):
    """qdq_math_session computes each DequantizeLinear of a constant once, as ORT's kernel does: the outputs
    are those of ORT running every DequantizeLinear as written."""
    import onnxruntime as ort

    from pipeline.backends.onnxruntime.session import fold_constant_dequantize, qdq_math_session
    from pipeline.calibrate.collect import CalibrationMethod, collect
    from pipeline.data.adapters import Batch, synthetic_batches
    from pipeline.quant.calibration import Calibration
    from pipeline.quant.placement import onnxruntime_plan, resolve_rules
    from pipeline.quant.qdq import apply_plan

    model = make()
    feeds = [f for f, _ in synthetic_batches(input_specs(model), 4, 0)]
    stats = collect(model, lambda: iter([Batch(f, None, 1) for f in feeds]), CalibrationMethod("minmax", 99.99, 2048),
                    1, lambda it, desc: it)
    rules = resolve_rules(model, [{"module_name": "*", "weights": {"dtype": "int8"},
                                   "activations": {"dtype": "uint8"}}])
    plan = onnxruntime_plan(model, rules, "uint8", per_channel=storage != "int8 per tensor",
                            weight_range="uint8" if storage == "uint8 weights" else "full")
    q = apply_plan(model, plan, Calibration(stats))
    folded = fold_constant_dequantize(q)
    assert sum(n.op_type == "DequantizeLinear" for n in folded.model.graph.node) < \
        sum(n.op_type == "DequantizeLinear" for n in q.graph.node)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    as_written = ort.InferenceSession(q.SerializeToString(), so, providers=["CPUExecutionProvider"])
    math = qdq_math_session(q, 1)
    for feed in feeds:
        for a, b in zip(as_written.run(None, feed), math.run(None, feed), strict=True):
            assert np.array_equal(a, b)


def test_the_reference_of_a_saved_qdq_model_is_its_math_with_the_weights_computed_once(tmp_path):
    """prepare_reference of a Q/DQ model saved with external data: its DequantizeLinear of constants are
    handed to ORT computed (none is left in the session's graph), and its outputs are those of ORT running
    every DequantizeLinear as written, bit for bit."""
    import onnxruntime as ort

    from pipeline.backends.onnxruntime.session import fold_constant_dequantize
    from pipeline.calibrate.collect import CalibrationMethod, collect
    from pipeline.data.adapters import Batch, synthetic_batches
    from pipeline.graph.model import save_model
    from pipeline.quant.calibration import Calibration
    from pipeline.quant.placement import onnxruntime_plan, resolve_rules
    from pipeline.quant.qdq import apply_plan
    from tests.helpers import ort_backend

    model = models.transformer_layer()
    feeds = [f for f, _ in synthetic_batches(input_specs(model), 3, 0)]
    stats = collect(model, lambda: iter([Batch(f, None, 1) for f in feeds]), CalibrationMethod("minmax", 99.99, 2048),
                    1, lambda it, desc: it)
    rules = resolve_rules(model, [{"module_name": "*", "weights": {"dtype": "int8"}, "activations": {"dtype": "uint8"}}])
    q = apply_plan(model, onnxruntime_plan(model, rules, "uint8"), Calibration(stats))
    path = save_model(q, tmp_path / "q.onnx", external_data=True)
    assert (tmp_path / "q.onnx.data").exists() or list(tmp_path.glob("*.data"))
    weights_dq = [n for n in q.graph.node if n.op_type == "DequantizeLinear"
                  and n.input[0] in {i.name for i in q.graph.initializer}]
    assert weights_dq and not set(fold_constant_dequantize(q).values) ^ {n.output[0] for n in weights_dq}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    as_written = ort.InferenceSession(q.SerializeToString(), so, providers=["CPUExecutionProvider"])
    with ort_backend().prepare_reference(path) as ref:
        for feed in feeds:
            for a, b in zip(as_written.run(None, feed), ref.run(feed), strict=True):
                assert np.array_equal(a, b)
