"""TensorRT backends without a GPU.

TensorRT-RTX parses and builds on a CPU-only machine, so these tests prove that float, INT8 Q/DQ and
FP8 Q/DQ models become engines (strongly typed where they carry Q/DQ), that parser errors name their
nodes, and that measuring says a GPU is needed. The Q/DQ models are made here with onnx.helper in the
layout TensorRT recommends: per-tensor activation scales, per-channel weight scales on the output
channel axis, zero points of the quantized type. Also: backend=tensorrt without the `tensorrt`
module fails at start-up with one line naming the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.backends import check_backend, create_backend
from pipeline.backends.tensorrt import TensorRTBackend
from pipeline.backends.tensorrt.common import EngineBuildConfig
from pipeline.errors import BackendUnavailable, StageError
from tests import models
from tests.helpers import compose, qdq_conv_chain, run_tune

# --------------------------------------------------------------------------- Q/DQ test models

_QMAX = {"int8": 127.0, "fp8": 448.0}
_ZP_TYPE = {"int8": TensorProto.INT8, "fp8": TensorProto.FLOAT8E4M3FN}


def insert_qdq(model: onnx.ModelProto, kind: str) -> onnx.ModelProto:
    """Quantize the inputs of every Conv / Gemm / MatMul with a weight initializer.

    int8: activations Q->DQ, weights stored as int8 with a DequantizeLinear (what a PTQ tool writes).
    fp8 (E4M3FN, opset 19): activations and weights both as Q->DQ pairs on float tensors.
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    zp_type, qmax = _ZP_TYPE[kind], _QMAX[kind]
    nodes, extra = [], []
    for node in g.node:
        if node.op_type in ("Conv", "Gemm", "MatMul") and len(node.input) > 1 and node.input[1] in inits:
            x, w = node.input[0], node.input[1]
            p = node.name
            extra += [numpy_helper.from_array(np.array(4.0 / qmax, np.float32), f"{p}/x_scale"),
                      helper.make_tensor(f"{p}/x_zp", zp_type, [], [0])]
            nodes += [helper.make_node("QuantizeLinear", [x, f"{p}/x_scale", f"{p}/x_zp"], [f"{p}/x_q"],
                                       name=f"{p}/in_q"),
                      helper.make_node("DequantizeLinear", [f"{p}/x_q", f"{p}/x_scale", f"{p}/x_zp"],
                                       [f"{p}/x_dq"], name=f"{p}/in_dq")]
            wf = numpy_helper.to_array(inits[w])
            # output channels: axis 0 for Conv and Gemm(transB=1) weights, axis 1 for MatMul's [K, N]
            axis = 1 if node.op_type == "MatMul" else 0
            moved = np.moveaxis(wf, axis, 0).reshape(wf.shape[axis], -1)
            scale = np.maximum(np.abs(moved).max(1), 1e-8).astype(np.float32) / qmax
            n = wf.shape[axis]
            extra += [numpy_helper.from_array(scale, f"{p}/w_scale"),
                      helper.make_tensor(f"{p}/w_zp", zp_type, [n], [0] * n)]
            if kind == "int8":
                shape = [1] * wf.ndim
                shape[axis] = n
                wq = np.clip(np.round(wf / scale.reshape(shape)), -127, 127).astype(np.int8)
                extra.append(numpy_helper.from_array(wq, f"{p}/w_int8"))
                nodes.append(helper.make_node("DequantizeLinear", [f"{p}/w_int8", f"{p}/w_scale", f"{p}/w_zp"],
                                              [f"{p}/w_dq"], name=f"{p}/w_dq", axis=axis))
            else:
                nodes += [helper.make_node("QuantizeLinear", [w, f"{p}/w_scale", f"{p}/w_zp"], [f"{p}/w_q"],
                                           name=f"{p}/w_q", axis=axis),
                          helper.make_node("DequantizeLinear", [f"{p}/w_q", f"{p}/w_scale", f"{p}/w_zp"],
                                           [f"{p}/w_dq"], name=f"{p}/w_dq", axis=axis)]
            node.input[0], node.input[1] = f"{p}/x_dq", f"{p}/w_dq"
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(extra)
    if kind == "fp8":
        m.opset_import[0].version = 19  # FLOAT8 Q/DQ needs opset 19
        m.ir_version = 9
    onnx.checker.check_model(m, full_check=True)
    return m


def unsupported_model() -> onnx.ModelProto:
    """Relu -> Unique: valid ONNX that TensorRT has no importer for."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu0"),
             helper.make_node("Unique", ["r"], ["y"], name="bad_node")]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def rtx_module():
    if importlib.util.find_spec("tensorrt_rtx") is not None:
        return importlib.import_module("tensorrt_rtx")
    return pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX bindings missing: pip install "
                                                               "'qdq-tune[rtx]'")


@pytest.fixture
def rtx(rtx_module):
    return create_backend(compose(["backend=tensorrt_rtx"]).backend)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# --------------------------------------------------------------------------- TensorRT-RTX builds


@pytest.mark.rtx
def test_fp32_model_builds(rtx, tmp_path):
    model = models.save(models.conv_chain(), tmp_path, "fp32")
    engine, log_path = tmp_path / "out" / "model.engine", tmp_path / "out" / "build.log"
    res = rtx.build(model, engine, log_path)
    assert engine.stat().st_size > 0 and res.info["engine_bytes"] == engine.stat().st_size
    assert res.info["strongly_typed"] is False and res.info["data_type"] == "FP32"
    text = log_path.read_text()
    assert "building" in text and "Layers:" in text
    assert res.info["module"] in ("tensorrt_rtx", "tensorrt_rtx_bindings") and res.info["version"]


@pytest.mark.rtx
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("builder", [models.conv_chain, models.residual_block, models.attention_block])
def test_qdq_models_build_strongly_typed(rtx, tmp_path, kind, builder):
    path = tmp_path / f"{builder.__name__}_{kind}.onnx"
    onnx.save(insert_qdq(builder(), kind), str(path))
    engine, log_path = tmp_path / "model.engine", tmp_path / "build.log"
    res = rtx.build(path, engine, log_path)
    assert engine.stat().st_size > 0 and log_path.stat().st_size > 0
    assert res.info["strongly_typed"] is True


@pytest.mark.rtx
def test_layer_info_without_gpu_lists_fused_qdq_nodes(rtx, tmp_path):
    path = tmp_path / "int8.onnx"
    onnx.save(insert_qdq(models.conv_chain(), "int8"), str(path))
    info = rtx.layer_info(path)
    assert info["source"] in ("build_log", "inspector")
    fused = {n for layer in info["layers"] for n in layer["onnx_nodes"]}
    assert {"conv1", "conv1/in_dq", "conv1/w_dq", "conv2", "fc"} <= fused


@pytest.mark.rtx
def test_unsupported_op_names_the_node(rtx, tmp_path):
    path = tmp_path / "bad.onnx"
    onnx.save(unsupported_model(), str(path))
    log_path = tmp_path / "build.log"
    with pytest.raises(StageError) as exc:
        rtx.build(path, tmp_path / "bad.engine", log_path)
    msg = str(exc.value)
    assert "node 'bad_node' (Unique)" in msg and str(log_path) in msg and len(msg.splitlines()) == 1
    assert "parser error: node 'bad_node'" in log_path.read_text()
    assert not (tmp_path / "bad.engine").exists()


@pytest.mark.rtx
def test_dynamic_batch_gets_a_profile(rtx, tmp_path):
    path = models.save(models.with_dynamic_batch(models.conv_chain()), tmp_path, "dyn")
    res = rtx.build(path, tmp_path / "dyn.engine", None, EngineBuildConfig(min_batch_size=1, opt_batch_size=4, max_batch_size=8))
    assert res.info["profile"] == {"input": {"min": [1, 3, 16, 16], "opt": [4, 3, 16, 16], "max": [8, 3, 16, 16]}}
    with pytest.raises(StageError, match="needs all of min_shapes, opt_shapes and max_shapes"):
        rtx.build(path, None, None, EngineBuildConfig(opt_shapes={"input": [2, 3, 16, 16]}))


@pytest.mark.rtx
def test_fp16_request_and_timing_cache_are_skipped_with_a_note(rtx, tmp_path):
    path = models.save(models.conv_chain(), tmp_path, "fp32")
    cache = tmp_path / "timing.cache"
    log_path = tmp_path / "build.log"
    res = rtx.build(path, tmp_path / "m.engine", log_path, EngineBuildConfig(data_type="FP16", timing_cache=str(cache)))
    text = log_path.read_text()
    # TensorRT-RTX has no FP16 builder flag and deprecates the timing cache: both noted, neither fails
    assert "timing cache" in text and not cache.exists()
    assert res.info["data_type"] == ("FP16" if hasattr(rtx.trt.BuilderFlag, "FP16") else "FP32")


@pytest.mark.rtx
@pytest.mark.skipif(_has_cuda(), reason="a CUDA GPU is present")
def test_measuring_without_gpu_says_so(rtx, tmp_path):
    path = models.save(models.conv_chain(), tmp_path, "fp32")
    with pytest.raises(BackendUnavailable) as exc:
        rtx.measure(path)
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1
    assert "no CUDA GPU" in msg and "building engines works without one" in msg


@pytest.mark.rtx
def test_fast_kernels_follow_the_support_matrix(rtx):
    assert rtx.has_fast_kernels("fp8") and not rtx.has_fast_kernels("int8")


# --------------------------------------------------------------------------- gen_trt_engine settings


def test_stage_maps_gen_trt_engine_settings(tmp_path):
    from pipeline.backends.tensorrt.deploy import engine_options

    cfg = compose(["backend=tensorrt_rtx", "gen_trt_engine.tensorrt.data_type=FP16",
                   "gen_trt_engine.tensorrt.workspace_size=512", "gen_trt_engine.tensorrt.min_batch_size=1",
                   "gen_trt_engine.tensorrt.opt_batch_size=4", "gen_trt_engine.tensorrt.max_batch_size=8",
                   "++gen_trt_engine.tensorrt.min_shapes.ids=[1,8]", "++gen_trt_engine.tensorrt.opt_shapes.ids=[2,8]",
                   "++gen_trt_engine.tensorrt.max_shapes.ids=[4,8]",
                   f"gen_trt_engine.tensorrt.timing_cache={tmp_path / 'tc.cache'}"])
    opts = engine_options(cfg)
    assert (opts.data_type, opts.workspace_size) == ("FP16", 512)
    assert (opts.min_batch_size, opts.opt_batch_size, opts.max_batch_size) == (1, 4, 8)
    assert opts.min_shapes == {"ids": [1, 8]} and opts.max_shapes == {"ids": [4, 8]}
    assert opts.timing_cache_path == tmp_path / "tc.cache"


def test_the_gen_trt_engine_schema_is_the_build_options_the_builders_take():
    from omegaconf import OmegaConf

    cfg = compose(["gen_trt_engine.tensorrt.data_type=BF16", "gen_trt_engine.tensorrt.workspace_size=256",
                   "gen_trt_engine.tensorrt.max_batch_size=4"])
    options = OmegaConf.to_object(cfg.gen_trt_engine.tensorrt)
    assert isinstance(options, EngineBuildConfig)
    assert (options.data_type, options.workspace_size, options.max_batch_size) == ("BF16", 256, 4)


def test_inconsistent_shapes_fail_validation():
    from pipeline.config import validate
    from pipeline.errors import ConfigError

    cfg = compose(["++gen_trt_engine.tensorrt.opt_shapes.ids=[2,8]",
                   "++gen_trt_engine.tensorrt.min_shapes.x=[4,8]", "++gen_trt_engine.tensorrt.opt_shapes.x=[2,8]",
                   "++gen_trt_engine.tensorrt.max_shapes.x=[4,8]"])
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    assert "input 'ids' needs all of min_shapes, opt_shapes and max_shapes" in str(exc.value)
    assert "shapes of 'x' need min <= opt <= max" in str(exc.value)


# --------------------------------------------------------------------------- TensorRT missing


def test_tensorrt_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` fail like a missing package
    cfg = compose(["backend=tensorrt"])
    with pytest.raises(BackendUnavailable) as exc:
        check_backend(cfg)
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1
    assert "backend=tensorrt needs the TensorRT Python package" in msg
    assert "pip install 'qdq-tune[tensorrt]'" in msg and "backend=onnxruntime" in msg
    assert TensorRTBackend(cfg.backend).describe()["version"] == "not installed"


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed here")
def test_tensorrt_missing_fails_at_startup_through_the_cli(tmp_path):
    model = models.save(models.conv_chain(), tmp_path, "m")
    proc = run_tune(["stages=[export]", "backend=tensorrt", "model=onnx", f"model.onnx_path={model}",
                     f"results_dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "pip install 'qdq-tune[tensorrt]'" in err
    assert not (tmp_path / "r" / "export").exists()  # failed before any stage ran


# --------------------------------------------------------------------------- review follow-ups


@pytest.mark.rtx
def test_build_info_and_log_name_the_original_not_the_rewritten_copy(rtx, tmp_path):
    path = tmp_path / "u8.onnx"
    onnx.save(qdq_conv_chain(TensorProto.UINT8, 128), str(path))
    log_path = tmp_path / "build.log"
    res = rtx.build(path, tmp_path / "u8.engine", log_path)
    assert res.info["source"] == str(path) and res.info["data_type"] == "strongly_typed"
    text = log_path.read_text()
    assert "rewrote 1 uint8 asymmetric" in text and f"building {path}" in text
    # our own notes name the user's file (TensorRT's parser logs the path it was handed)
    assert not any(".s8." in ln for ln in text.splitlines() if ln.startswith("[qdq-tune]"))
    assert not list(tmp_path.glob(".u8.s8.*"))  # the temporary copy is gone


def test_engine_options_normalise_data_type_and_read_the_backend_section():
    from pipeline.backends.tensorrt.common import DataType

    assert EngineBuildConfig(data_type="fp16").data_type == "FP16"
    assert EngineBuildConfig(data_type=DataType.BF16).data_type == "BF16"
    with pytest.raises(ValueError, match="'FP8' is not a valid DataType"):
        EngineBuildConfig(data_type="fp8")
    cfg = compose(["backend=tensorrt_rtx", "backend.float_precision=bf16", "backend.workspace_size=64"])
    opts = EngineBuildConfig.from_backend_cfg(cfg.backend)
    assert opts.data_type == "BF16" and opts.workspace_size == 64 and opts.timing_cache is None
    assert TensorRTBackend(cfg.backend).default_options() == opts


def test_plugin_paths_are_absolute_checked_and_name_the_key(tmp_path, monkeypatch):
    from pipeline.backends.tensorrt.common import plugin_paths
    from pipeline.errors import InputError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "libp.so").write_bytes(b"\x7fELF")
    assert plugin_paths(["libp.so", str(tmp_path / "libp.so")]) == [str(tmp_path / "libp.so")]
    with pytest.raises(InputError, match=r"libq\.so does not exist \(gen_trt_engine\.tensorrt\.plugin_libraries\)"):
        plugin_paths(["libq.so"], "gen_trt_engine.tensorrt.plugin_libraries")


def test_shape_problems_reject_dims_below_one_naming_the_key():
    from pipeline.backend_config import shape_problems

    (msg,) = shape_problems({"x": [0, 3]}, {"x": [1, 3]}, {"x": [2, 3]})
    assert "gen_trt_engine.tensorrt.min_shapes.x=[0, 3]" in msg and ">= 1" in msg
    assert shape_problems({"x": [1, 3]}, {"x": [1, 3]}, {"x": [2, 3]}) == []
    (msg,) = shape_problems({}, {"x": [1, 3]}, {})
    assert "needs all of min_shapes, opt_shapes and max_shapes" in msg


def test_rejected_input_shape_is_one_line_naming_input_and_profile():
    from pipeline.backends.tensorrt.backend import TensorRTPrepared

    class Context:
        def set_input_shape(self, name, shape):
            return False

    class Engine:
        def get_tensor_profile_shape(self, name, i):
            return [(1, 3, 16, 16), (4, 3, 16, 16), (8, 3, 16, 16)]

    pm = TensorRTPrepared.__new__(TensorRTPrepared)
    pm.context, pm.engine, pm.input_names, pm.engine_outputs, pm.buffers = Context(), Engine(), ["input"], [], {}
    pm.torch = None
    with pytest.raises(StageError) as exc:
        pm._bind({"input": (16, 3, 16, 16)})
    msg = str(exc.value)
    assert len(msg.splitlines()) == 1 and "'input'" in msg and "[16, 3, 16, 16]" in msg
    assert "min [1, 3, 16, 16], opt [4, 3, 16, 16], max [8, 3, 16, 16]" in msg


class _FakeBuilderConfig:
    """IBuilderConfig's timing-cache calls as TensorRT documents them: create_timing_cache(bytes),
    set_timing_cache(cache, ignore_mismatch) -> False for a cache of another device or version."""

    def __init__(self, matches: bool):
        self.matches = matches

    def create_timing_cache(self, data: bytes) -> object:
        return ("cache", bytes(data))

    def set_timing_cache(self, cache: object, ignore_mismatch: bool) -> bool:
        return self.matches or cache == ("cache", b"")


class _Notes:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def note(self, text: str) -> None:
        self.lines.append(text)


@pytest.mark.parametrize("matches", [True, False])
def test_a_timing_cache_of_another_device_is_set_aside_not_overwritten(tmp_path, matches):
    from omegaconf import OmegaConf

    from pipeline.backends.tensorrt import TensorRTBackend
    from pipeline.backends.tensorrt.config import TensorRTBackendConfig

    cache = tmp_path / "tc.cache"
    cache.write_bytes(b"made elsewhere")
    backend, notes = TensorRTBackend(OmegaConf.structured(TensorRTBackendConfig())), _Notes()
    backend._use_timing_cache(_FakeBuilderConfig(matches), cache, notes)
    stale = list((tmp_path / "stale").glob("*/tc.cache"))
    if matches:
        assert cache.read_bytes() == b"made elsewhere" and not stale
    else:
        assert not cache.exists() and [p.read_bytes() for p in stale] == [b"made elsewhere"]
        assert "does not match this device/version; moved to" in notes.lines[-1]
