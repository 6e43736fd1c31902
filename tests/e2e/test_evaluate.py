"""The evaluate stage end to end: float-only runs, extra quantized models taken from the manifest,
identical files measured once, failures naming the file, and the default digits model's accuracy."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.artifacts import Manifest
from tests import models
from tests.helpers import PINNED_BACKEND, compose, run_tune

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# small timing budget: these tests check plumbing, not speed
FAST = [PINNED_BACKEND, "evaluate.max_batches=8", "evaluate.latency_repeats=2", "backend.timing_runs=6", "backend.warmup_runs=1"]


def _onnx_args(src: Path, results_dir: Path) -> list[str]:
    return ["model=onnx", f"model.onnx_path={src}", f"results_dir={results_dir}", *FAST]


def _perturbed(src: Path, dst: Path, scale: float = 0.2, seed: int = 1) -> Path:
    """A stand-in for a quantized model: the same graph with noisy weights."""
    m = onnx.load(str(src))
    rng = np.random.default_rng(seed)
    for i, init in enumerate(m.graph.initializer):
        w = numpy_helper.to_array(init)
        noisy = (w * (1 + scale * rng.standard_normal(w.shape))).astype(w.dtype)
        m.graph.initializer[i].CopyFrom(numpy_helper.from_array(noisy, init.name))
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(dst))
    return dst


def _register(results_dir: Path, stage: str, key: str, path: Path) -> None:
    manifest = Manifest(results_dir)
    manifest.update(stage, status="done", outputs={key: manifest.describe_file(path)})


def test_float_only_run_writes_metrics_report_and_plot(tmp_path):
    src = models.save(models.conv_chain(), tmp_path, "conv_chain")
    rd = tmp_path / "r"
    proc = run_tune(["stages=[export,evaluate]", *_onnx_args(src, rd)], cwd=tmp_path, check=True)
    metrics = json.loads((rd / "evaluate" / "metrics.json").read_text())
    assert list(metrics["models"]) == ["float"]
    flt = metrics["models"]["float"]
    assert flt["samples"] == 16 and flt["agreement"] == 1.0 and flt["top1"] is None
    assert flt["latency_ms"]["p10"] <= flt["latency_ms"]["median"] <= flt["latency_ms"]["p90"]
    assert metrics["baseline"].startswith("FP32 float model on onnxruntime")
    report = (rd / "evaluate" / "report.md").read_text()
    assert "| float | `export/model.onnx` |" in report and "stages=[export,evaluate]" in report
    png = (rd / "evaluate" / "summary.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    entry = json.loads((rd / "manifest.json").read_text())["stages"]["evaluate"]
    assert "evaluate/summary.png" in entry["outputs"] and entry["metrics"]["headline"].startswith("float ")
    assert "evaluate  done  float" in proc.stdout


def test_quantized_models_from_the_manifest_are_compared_with_float(tmp_path):
    src = models.save(models.conv_chain(), tmp_path, "conv_chain")
    rd = tmp_path / "r"
    run_tune(["stages=[export]", *_onnx_args(src, rd)], cwd=tmp_path, check=True)
    ptq = _perturbed(rd / "export" / "model.onnx", rd / "quantize" / "quantized_model.onnx")
    _register(rd, "quantize", "quantize/quantized_model.onnx", ptq)
    # an autotuned model byte-identical to the PTQ one is listed as such, not measured twice
    tuned = rd / "autotune" / "optimized_final.onnx"
    tuned.parent.mkdir()
    shutil.copy(ptq, tuned)
    _register(rd, "autotune", "autotune/optimized_final.onnx", tuned)

    proc = run_tune(["stages=[evaluate]", *_onnx_args(src, rd)], cwd=tmp_path, check=True)
    metrics = json.loads((rd / "evaluate" / "metrics.json").read_text())
    assert list(metrics["models"]) == ["float", "ptq"]
    q = metrics["models"]["ptq"]
    assert q["agreement"] < 1.0 or math.isfinite(q["snr_db"])
    assert q["snr_db"] is not None and 0 < q["cosine"] < 1.0 and not q["identical_outputs"]
    assert q["speedup"] > 0 and q["speedup_p10"] > 0
    assert metrics["duplicates"] == [{"model": "autotuned", "file": "autotune/optimized_final.onnx",
                                      "identical_to": "ptq"}]
    report = (rd / "evaluate" / "report.md").read_text()
    assert "| PTQ | `quantize/quantized_model.onnx` |" in report and "byte-identical to the PTQ model" in report
    assert "| ptq agree" in proc.stdout


def test_a_model_that_fails_to_run_is_named(tmp_path):
    src = models.save(models.conv_chain(), tmp_path, "conv_chain")
    rd = tmp_path / "r"
    run_tune(["stages=[export]", *_onnx_args(src, rd)], cwd=tmp_path, check=True)
    broken = models.conv_chain()
    broken.graph.node[1].op_type = "NoSuchOp"
    path = rd / "quantize" / "quantized_model.onnx"
    path.parent.mkdir()
    onnx.save(broken, str(path))
    _register(rd, "quantize", "quantize/quantized_model.onnx", path)
    proc = run_tune(["stages=[evaluate]", *_onnx_args(src, rd)], cwd=tmp_path)
    assert proc.returncode == 1
    assert "PTQ model quantize/quantized_model.onnx cannot be loaded by onnxruntime" in proc.stderr
    assert "NoSuchOp" in proc.stderr and "Traceback" not in proc.stderr


def _token_model(emb_scale: float = 1.0) -> onnx.ModelProto:
    """Integer input ids -> Gather -> mean -> Gemm, with two outputs (logits and the pooled features)."""
    rng = np.random.default_rng(0)
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [4, 6])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 5])
    pooled = helper.make_tensor_value_info("pooled", TensorProto.FLOAT, [4, 8])
    emb = rng.standard_normal((50, 8)).astype(np.float32) * emb_scale
    inits = [numpy_helper.from_array(emb, "emb"),
             numpy_helper.from_array(rng.standard_normal((5, 8)).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(5, np.float32), "b")]
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["x"], name="embed"),
             helper.make_node("ReduceMean", ["x"], ["pooled"], name="pool", axes=[1], keepdims=0),
             helper.make_node("Gemm", ["pooled", "w", "b"], ["logits"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "tokens", [ids], [logits, pooled], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def test_integer_inputs_and_several_outputs_in_process(tmp_path):
    import logging

    from pipeline.stage import StageContext
    from tasks.evaluate.stage import EvaluateStage

    rd = tmp_path / "r"
    flt = models.save(_token_model(), rd / "export", "model")
    m = _token_model()
    w = numpy_helper.to_array(m.graph.initializer[0])
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.round(w * 4) / 4, "emb"))  # coarse "quantized" table
    ptq = models.save(m, rd / "quantize", "quantized_model")
    _register(rd, "export", "export/model.onnx", flt)
    _register(rd, "quantize", "quantize/quantized_model.onnx", ptq)
    cfg = compose(["model=onnx", f"model.onnx_path={flt}", f"results_dir={rd}", "progress=false",
                   "evaluate.plot=false", *FAST])
    ctx = StageContext(cfg=cfg, results_dir=rd, manifest=Manifest(rd), log=logging.getLogger("test"))
    result = EvaluateStage().run(ctx)
    assert set(result.artifacts) == {"evaluate/metrics.json", "evaluate/report.md"}
    q = result.metrics.models["ptq"].scores
    snr_db_per_output = [o.snr_db for o in q.outputs]
    assert q.samples == 32 and len(snr_db_per_output) == 2
    assert all(v is not None and math.isfinite(v) and v > 10 for v in snr_db_per_output)
    assert 0.9 < q.cosine <= 1.0 and q.agreement is not None
    assert "tune " in result.metrics.reproduce.evaluate_only


@pytest.mark.slow
def test_default_digits_model_float_accuracy(digits_results, tmp_path):
    rd = tmp_path / "digits"
    shutil.copytree(digits_results, rd)  # the session's trained and exported default model
    run_tune(["stages=[export,evaluate]", f"results_dir={rd}"], cwd=tmp_path, check=True)
    metrics = json.loads((rd / "evaluate" / "metrics.json").read_text())
    flt = metrics["models"]["float"]
    assert metrics["data"]["labelled"] and metrics["data"]["source"] == "digits"
    assert flt["top1"] >= 0.95 and flt["top5"] >= flt["top1"]
    assert flt["samples"] == 540  # the whole held-out split, last batch padded
