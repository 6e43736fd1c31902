"""backend=openvino on tiny models: the protocol (run, time, per-layer times, the runtime graph's
layers, the IR and compiled blob it builds), the placement kind for OpenVINO's int8 rules, and one
line with exit 2 for a missing OpenVINO or a bad compile value."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from omegaconf import OmegaConf

from pipeline.backends.onnxruntime.session import inference_session
from pipeline.backends.openvino.config import OpenVinoBackendConfig
from pipeline.data.adapters import fixed_feeds
from pipeline.graph.model import input_specs
from pipeline.quant.placement import onnxruntime_plan, openvino_plan, resolve_rules
from tests import models
from tests.helpers import run_tune, tune_in_process

ov = pytest.importorskip("openvino", reason="backend=openvino needs OpenVINO: pip install openvino")

INT8 = [{"module_name": "*", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}}]


def _backend(**cfg):
    from pipeline.backends.openvino import OpenVinoBackend

    return OpenVinoBackend(OmegaConf.structured(OpenVinoBackendConfig(**cfg)))


def test_runs_times_and_profiles_a_model_close_to_onnx_runtime(tmp_path):
    model = models.conv_chain()
    path = models.save(model, tmp_path, "m")
    feeds = fixed_feeds(input_specs(model))
    want = inference_session(path).run(None, feeds)[0]
    b = _backend(inference_precision="f32")
    with b.prepare(path, profile=True) as pm:
        got = pm.run(feeds)[0]
        times = [pm.time_runs(3), pm.time_runs(2)]
        samples = pm.layer_samples()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert pm.output_names == [o.name for o in model.graph.output]  # what accuracy.outputs names
    assert [len(t) for t in times] == [3, 2] and all(x > 0 for t in times for x in t)
    assert [len(c) for c in samples] == [3, 2] and all(run for c in samples for run in c)
    compute = {k for run in samples[0] for k in run} - pm.overhead_layers
    assert compute, "every layer counted as edge overhead"
    assert b.float_precision() == "FP32" and _backend().float_precision() in ("BF16", "FP32", "FP16")


def test_outputs_after_an_identity_chain_keep_the_onnx_graph_names(tmp_path):
    # OpenVINO folds Identity chains and keeps every folded name on the port (as silero-vad's
    # inlined If outputs): the graph output's own name is the one accuracy.outputs and reports use
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["branch_out"]),
             helper.make_node("Identity", ["branch_out"], ["y"]), helper.make_node("Neg", ["x"], ["z0"]),
             helper.make_node("Identity", ["z0"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with _backend().prepare(models.save(model, tmp_path, "ids")) as pm:
        assert pm.output_names == ["y", "z"]
        y, z = pm.run({"x": np.array([[-1, 2, -3, 4]], np.float32)})
    np.testing.assert_allclose(y, [[0, 2, 0, 4]])
    np.testing.assert_allclose(z, [[1, -2, 3, -4]])


def test_layer_info_names_the_onnx_nodes_of_each_runtime_layer(tmp_path):
    model = models.conv_chain()
    info = _backend().layer_info(models.save(model, tmp_path, "m"))
    names = {n.name for n in model.graph.node}
    convs = [layer for layer in info["layers"] if layer["LayerType"] == "Convolution"]
    assert len(convs) == sum(n.op_type == "Conv" for n in model.graph.node)
    assert all(set(layer["onnx_nodes"]) & names for layer in convs)
    assert info["inference_precision"] in ("bf16", "f32", "f16")


def test_build_writes_ir_and_a_compiled_blob_that_loads(tmp_path):
    model = models.conv_chain()
    path = models.save(model, tmp_path, "m")
    result = _backend().build(path, tmp_path / "out" / "model.xml", tmp_path / "out" / "build.json")
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == {"model.xml", "model.bin", "model.blob", "build.json"}
    assert result.info["layer_precisions"] and result.info["inference_precision"]
    core = ov.Core()
    compiled = core.import_model((out / "model.blob").read_bytes(), "CPU")
    feeds = fixed_feeds(input_specs(model))
    got = compiled.create_infer_request().infer(feeds)[compiled.outputs[0]]
    ir = core.compile_model(core.read_model(str(out / "model.xml")), "CPU").create_infer_request().infer(feeds)
    assert got.shape == tuple(model.graph.output[0].type.tensor_type.shape.dim[i].dim_value for i in range(2))
    assert np.isfinite(ir[0]).all()


def test_openvino_placement_quantizes_only_the_inputs_of_matmuls_as_int8():
    model = models.attention_block()
    rules = resolve_rules(model, INT8)
    plan = openvino_plan(model, rules, "uint8")
    matmuls = {n.name for n in model.graph.node if n.op_type == "MatMul"}
    assert plan.activations and all(a.dtype == "int8" for a in plan.activations)
    # quantized for the MatMuls that read them only: Softmax, LayerNorm and residual Adds read float
    assert all(a.consumers and {c for c, _ in a.consumers} <= matmuls for a in plan.activations)
    assert not plan.biases  # no ORT int32 QGemm bias
    assert {w.node for w in plan.weights} <= matmuls


def test_openvino_placement_follows_onnx_runtime_groups_in_conv_chains():
    model = models.residual_block()
    rules = resolve_rules(model, INT8)
    ov_plan, ort_plan = openvino_plan(model, rules, "uint8"), onnxruntime_plan(model, rules, "uint8")
    convs = {n.name for n in model.graph.node if n.op_type == "Conv"}
    assert convs <= set(ov_plan.node_rules)
    conv_inputs = {t for n in model.graph.node if n.op_type == "Conv" for t in n.input}
    conv_acts = {(a.tensor, a.dtype) for a in ort_plan.activations if a.tensor in conv_inputs}
    assert conv_acts <= {(a.tensor, a.dtype) for a in ov_plan.activations}
    assert {a.dtype for a in ov_plan.activations if a.tensor in {t for t, _ in conv_acts}} == {"uint8"}


def test_openvino_placement_feeds_a_classifier_head_the_pooled_u8_and_its_fc_runs_u8(tmp_path):
    from pipeline.backends.openvino.backend import runtime_layers
    from pipeline.quant.calibration import Calibration
    from pipeline.quant.qdq import apply_plan

    model = models.conv_chain(channels=16, classes=16)  # ... Relu -> GlobalAveragePool -> Flatten -> Gemm
    plan = openvino_plan(model, resolve_rules(model, INT8), "uint8")
    by_tensor = {a.tensor: a for a in plan.activations}
    assert by_tensor["gap"].dtype == "uint8" and by_tensor["r2"].dtype == "uint8" and "flat" not in by_tensor
    assert "fc" in {w.node for w in plan.weights}
    layers = runtime_layers(_backend().compile(models.save(apply_plan(model, plan, Calibration(default_scale=0.05)),
                                                            tmp_path, "q")))
    fc = [layer for layer in layers if layer["LayerType"].startswith("FullyConnected")]
    assert [layer["precision"] for layer in fc] == ["u8"]
    # nothing requantizes between the pooling and the FullyConnected: the only float layer quantizes the input
    assert [layer["onnx_nodes"] for layer in layers if layer["LayerType"] == "Subgraph"] == [["input_QuantizeLinear"]]


def test_compile_settings_reject_unknown_properties_and_bad_values(tmp_path):
    from pipeline.backends.openvino.settings import CompileSettings
    from pipeline.errors import StateError

    s = CompileSettings.from_dict({"INFERENCE_PRECISION_HINT": "F32", "NUM_STREAMS": 1})
    assert s.to_dict() == {"INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": "1"}
    assert s.changed(NUM_STREAMS=None).to_dict() == {"INFERENCE_PRECISION_HINT": "f32"}
    with pytest.raises(ValueError, match="unknown OpenVINO property 'TURBO'"):
        CompileSettings.from_dict({"TURBO": "YES"})
    with pytest.raises(ValueError, match="choose one of"):
        CompileSettings.from_dict({"PERFORMANCE_HINT": "FAST"})
    bad = tmp_path / "openvino_compile.json"
    bad.write_text('{"NUM_STREAMS": "many"}')
    with pytest.raises(StateError, match="openvino_compile.json are corrupt"):
        CompileSettings.load(bad)


def test_a_bad_precision_is_one_line_and_exit_2(tmp_path):
    proc = tune_in_process(["backend=openvino", "backend.inference_precision=bf17", f"results_dir={tmp_path}/r",
                            "--cfg", "job"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "backend.inference_precision" in proc.stderr
    assert "bf16" in proc.stderr and not (tmp_path / "r").exists()


def test_missing_openvino_is_one_line_naming_the_install_and_exit_2(tmp_path):
    fake = tmp_path / "fake"
    (fake / "openvino").mkdir(parents=True)
    (fake / "openvino" / "__init__.py").write_text("raise ImportError('no openvino here')\n")
    proc = run_tune(["backend=openvino", f"results_dir={tmp_path}/r", "stages=[export]"], cwd=tmp_path,
                    env={"PYTHONPATH": str(fake)})
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install openvino" in lines[0], proc.stderr
    assert not (tmp_path / "r" / "export").exists()


def test_quantize_judges_candidates_on_openvino(tmp_path):
    """quantize with backend=openvino places for OpenVINO and checks the model OpenVINO runs."""
    path = models.save(models.conv_chain(), tmp_path, "m")
    rd = tmp_path / "run"
    run_tune(["model=onnx", f"model.onnx_path={path}", "data=synthetic", "data.num_samples=16",
              "quantize.calibration.batches=2", "stages=[export,quantize]", "backend=openvino",
              f"results_dir={rd}", "progress=false"], cwd=tmp_path, check=True)
    q = onnx.load(str(rd / "quantize" / "quantized_model.onnx"))
    assert any(n.op_type == "QuantizeLinear" for n in q.graph.node)
    import json

    metrics = json.loads((rd / "manifest.json").read_text())["stages"]["quantize"]["metrics"]
    assert metrics["placement"] == "openvino"


def test_the_classifier_head_rule_leaves_a_pooling_left_float_and_a_graph_output_alone():
    model = models.conv_chain(channels=16, classes=16)
    skipped = openvino_plan(model, resolve_rules(model, INT8, skip_names=["gap"]), "uint8")
    # the pooling is left float: the Gemm's input gets its own int8 Q after Flatten, as before the rule
    assert {(a.tensor, a.dtype) for a in skipped.activations} >= {("flat", "int8")}
    assert "gap" not in {a.tensor for a in skipped.activations}
    model.graph.output.append(onnx.helper.make_tensor_value_info("flat", onnx.TensorProto.FLOAT, None))
    plan = openvino_plan(model, resolve_rules(model, INT8), "uint8")
    # "flat" is read outside the graph too: no Q/DQ goes between the pooling and that output
    assert "gap" not in {a.tensor for a in plan.activations}
    assert [a.consumers for a in plan.activations if a.tensor == "flat"] == [(("fc", 0),)]
