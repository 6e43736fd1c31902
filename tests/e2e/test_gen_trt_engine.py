"""`tune stages=[export,gen_trt_engine]` end to end: a TensorRT-RTX engine built on the CPU, ONNX Runtime's
optimized graph for backend=onnxruntime, and one-line failures for unparsable or missing models."""

from __future__ import annotations

import importlib.util
import json

import onnx
import pytest
from onnx import TensorProto, helper

from tests import models
from tests.helpers import run_tune

HAS_RTX = any(importlib.util.find_spec(m) is not None for m in ("tensorrt_rtx", "tensorrt_rtx_bindings"))
needs_rtx = pytest.mark.skipif(not HAS_RTX, reason="TensorRT-RTX bindings missing: pip install 'qdq-tune[rtx]'")


def _stage(results, name: str) -> dict:
    return json.loads((results / "manifest.json").read_text())["stages"][name]


@pytest.mark.rtx
@needs_rtx
def test_tensorrt_rtx_engine_from_export(tmp_path):
    model = models.save(models.residual_block(), tmp_path, "residual")
    results = tmp_path / "r"
    proc = run_tune(["stages=[export,gen_trt_engine]", "backend=tensorrt_rtx", "model=onnx",
                     f"model.onnx_path={model}", f"results_dir={results}"], cwd=tmp_path, check=True)
    entry = _stage(results, "gen_trt_engine")
    assert entry["status"] == "done"
    assert set(entry["outputs"]) == {"gen_trt_engine/model.engine", "gen_trt_engine/build.log"}
    engine, build_log = results / "gen_trt_engine" / "model.engine", results / "gen_trt_engine" / "build.log"
    assert engine.stat().st_size > 0 and build_log.stat().st_size > 0
    m = entry["metrics"]
    assert m["source"] == "export/model.onnx" and m["engine_bytes"] == engine.stat().st_size
    assert m["build_seconds"] >= 0 and "tensorrt_rtx engine from export/model.onnx" in m["headline"]
    assert m["headline"] in proc.stdout
    # unchanged inputs and config: skipped on the second run
    again = run_tune(["stages=[export,gen_trt_engine]", "backend=tensorrt_rtx", "model=onnx",
                      f"model.onnx_path={model}", f"results_dir={results}"], cwd=tmp_path, check=True)
    assert "gen_trt_engine: up to date, skipped" in again.stderr


def test_onnxruntime_writes_its_optimized_graph(tmp_path):
    model = models.save(models.conv_chain(), tmp_path, "conv")
    results = tmp_path / "r"
    proc = run_tune(["stages=[export,gen_trt_engine]", "model=onnx", f"model.onnx_path={model}",
                     f"results_dir={results}"], cwd=tmp_path, check=True)
    entry = _stage(results, "gen_trt_engine")
    assert set(entry["outputs"]) == {"gen_trt_engine/model.ort.onnx", "gen_trt_engine/build.json"}
    onnx.checker.check_model(onnx.load(str(results / "gen_trt_engine" / "model.ort.onnx")))
    assert not (results / "gen_trt_engine" / "model.engine").exists()
    assert entry["metrics"]["headline"].startswith("onnxruntime optimized graph from export/model.onnx")
    assert "has no TensorRT engine to build" in proc.stderr


def test_trtexec_backend_builds_through_the_stage(tmp_path):
    from tests.helpers import calls_of, fake_trtexec

    exe, calls = fake_trtexec(tmp_path)
    model = models.save(models.conv_chain(), tmp_path, "conv")
    results = tmp_path / "r"
    run_tune(["stages=[export,gen_trt_engine]", "backend=trtexec", f"backend.trtexec_path={exe}",
              "backend.trtexec_args=['--builderOptimizationLevel=4']", "model=onnx", f"model.onnx_path={model}",
              "gen_trt_engine.tensorrt.workspace_size=256", "gen_trt_engine.tensorrt.timing_cache=tc.cache",
              f"results_dir={results}"], cwd=tmp_path, check=True)
    (argv,) = calls_of(calls)
    assert f"--timingCacheFile={tmp_path / 'tc.cache'}" in argv  # relative to where tune was started
    assert "--memPoolSize=workspace:256M" in argv and argv[-1] == "--builderOptimizationLevel=4"
    assert (results / "gen_trt_engine" / "model.engine").read_bytes() == b"fake serialized engine"
    assert (results / "gen_trt_engine" / "build.log").read_text().startswith("$ ")


@pytest.mark.rtx
@needs_rtx
def test_unparsable_model_fails_naming_the_node(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="relu0"),
                               helper.make_node("Unique", ["r"], ["y"], name="bad_node")], "g", [x], [y])
    bad = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(bad))
    results = tmp_path / "r"
    proc = run_tune(["stages=[gen_trt_engine]", "backend=tensorrt_rtx", f"gen_trt_engine.onnx_file={bad}",
                     f"results_dir={results}"], cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tune: error:") and "node 'bad_node' (Unique)" in last and "Traceback" not in proc.stderr
    assert (results / "gen_trt_engine" / "build.log").exists()
    assert _stage(results, "gen_trt_engine")["status"] == "failed"


def test_no_model_says_to_run_export(tmp_path):
    proc = run_tune(["stages=[gen_trt_engine]", f"results_dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "run stage 'export' first" in last and "gen_trt_engine.onnx_file" in last


@pytest.mark.rtx
@needs_rtx
def test_default_model_builds_with_tensorrt_rtx(digits_results, tmp_path):
    """The default digits model, exported once per session: `tune stages=[export,gen_trt_engine] backend=tensorrt_rtx`."""
    import shutil

    results = tmp_path / "digits"
    shutil.copytree(digits_results, results, ignore=shutil.ignore_patterns(".lock"))
    proc = run_tune(["stages=[export,gen_trt_engine]", "backend=tensorrt_rtx", f"results_dir={results}"],
                    cwd=tmp_path, check=True)
    assert "export: up to date, skipped" in proc.stderr
    assert (results / "gen_trt_engine" / "model.engine").stat().st_size > 0
    assert (results / "gen_trt_engine" / "build.log").stat().st_size > 0


def test_garbage_onnx_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "garbage.onnx"
    bad.write_bytes(b"\x08\xff\xff this is not a protobuf \x00\x01\x02" * 8)
    results = tmp_path / "r"
    proc = run_tune(["stages=[gen_trt_engine]", f"gen_trt_engine.onnx_file={bad}", f"results_dir={results}"],
                    cwd=tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tune: error:") and "gen_trt_engine.onnx_file" in last and "could not be read" in last
    assert "Traceback" not in proc.stderr


def test_onnxruntime_graph_that_loads_but_does_not_run_is_not_written(tmp_path):
    import numpy as np
    from onnx import numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])
    idx = numpy_helper.from_array(np.array([7], np.int64), "idx")  # row 7 of a 4-row input
    graph = helper.make_graph([helper.make_node("Gather", ["x", "idx"], ["y"], name="gather")], "g", [x], [y], [idx])
    bad = tmp_path / "gather.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(bad))
    results = tmp_path / "r"
    proc = run_tune(["stages=[gen_trt_engine]", f"gen_trt_engine.onnx_file={bad}", f"results_dir={results}"],
                    cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tune: error: gen_trt_engine: onnxruntime cannot load and run"), last
    assert not (results / "gen_trt_engine" / "model.ort.onnx").exists()
