"""Models whose compute sits inside control flow: a keras2onnx-style Scan RNN and a scripted-torch-style Loop
RNN go through the whole pipeline with the MatMuls of their bodies quantized and calibrated from inside
the bodies, within the accuracy budget; a model whose compute sits only in the branches of an If on data
still refuses with one line."""

from __future__ import annotations

import json

import onnx
import pytest

from pipeline.backends.onnxruntime.session import inference_session
from tests import models
from tests.helpers import body_matmuls, run_tune

pytestmark = pytest.mark.slow

# builder -> (its Loop/Scan node, tensors inside the body)
BODIES = {"scan_rnn": ("rnn/Scan", ["rnn/x_t", "rnn/h_prev", "rnn/xw", "rnn/hr", "rnn/h_new"]),
          "loop_rnn": ("loop/Loop", ["loop/x_t", "loop/h", "loop/xw", "loop/hr", "loop/h_next"])}


@pytest.mark.parametrize("builder", list(BODIES))
def test_rnn_inside_a_loop_or_scan_body_is_quantized_tuned_and_evaluated_within_budget(builder, tmp_path):
    path = models.save(getattr(models, builder)(), tmp_path, builder)
    rd = tmp_path / "run"
    run_tune([f"results_dir={rd}", "model=onnx", f"model.onnx_path={path}",
              "stages=[export,quantize,autotune,evaluate]", "autotune.preset=quick", "evaluate.plot=false",
              "progress=false"], cwd=tmp_path, check=True, timeout=600)
    stages = json.loads((rd / "manifest.json").read_text())["stages"]
    q = stages["quantize"]["metrics"]
    assert q["accuracy"]["ok"] and q["body_nodes"] == 2, q["headline"]
    assert "2 nodes inside Loop/Scan bodies quantized" in q["headline"]
    node, tensors = BODIES[builder]
    calib = json.loads((rd / "quantize" / "calibration.json").read_text())
    samples = calib["tensors"]["input"]["samples"]
    assert samples > 0 and all(calib["tensors"][t]["samples"] == samples for t in tensors)
    assert list(calib["bodies"]) == [node] and "W" in calib["weights"]
    qmodel = onnx.load(str(rd / "quantize" / "quantized_model.onnx"))
    assert list(body_matmuls(qmodel).values()) == [["DequantizeLinear", "DequantizeLinear"]] * 2
    inference_session(qmodel)
    assert stages["autotune"]["metrics"]["accuracy"]["final"]["ok"]
    metrics = json.loads((rd / "evaluate" / "metrics.json").read_text())
    assert not metrics["over_budget"], metrics["over_budget"]
    report = (rd / "evaluate" / "report.md").read_text()
    assert "Inside Loop/Scan bodies: 2 nodes quantized" in report
    from tasks.autotune.region.inspect import inspect_model

    inspected = inspect_model(rd / "quantize" / "quantized_model.onnx")
    assert f"{node.split('/')[1]} {node}: " in inspected and "2 of 2 weighted ops quantized" in inspected, inspected


def test_compute_only_inside_if_branches_on_data_refuses_with_one_line(tmp_path):
    path = models.save(models.if_on_data(), tmp_path, "if_on_data")
    proc = run_tune([f"results_dir={tmp_path / 'run'}", "model=onnx", f"model.onnx_path={path}",
                     "stages=[export,quantize]", "progress=false"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tune: error: quantize: all 2 weighted ops of this model sit inside If/Loop/Scan "
                           "bodies") and "If bodies stay float" in last, last
