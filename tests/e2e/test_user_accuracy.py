"""Accuracy as the user defines it, from the command line: a custom metric from a module on PYTHONPATH
judges quantize, autotune and evaluate; a metric that raises, returns NaN or does not exist is one
line and exit 2 with nothing half-written; accuracy.outputs names outputs the model has."""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx
import pytest

from tests import models
from tests.helpers import QUICK, run_tune

METRICS = '''
import numpy as np

CALLS = []


def agreement(outputs, reference, labels):
    """Percent of samples whose argmax matches the float model's."""
    same = sum(int(np.sum(np.argmax(o["logits"], -1) == np.argmax(r["logits"], -1)))
               for o, r in zip(outputs, reference, strict=True))
    return 100.0 * same / sum(len(r["logits"]) for r in reference)


def boom(outputs, reference, labels):
    raise ValueError("no boxes in this batch")


def nan(outputs, reference, labels):
    return float("nan")
'''


@pytest.fixture
def setup(tmp_path) -> tuple[Path, dict[str, str]]:
    (tmp_path / "my_metrics.py").write_text(METRICS)
    model = models.save(models.conv_chain(), tmp_path, "m")
    return model, {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def _args(model: Path, rd: Path, extra: list[str]) -> list[str]:
    return ["stages=[export,quantize,autotune,evaluate]", "model=onnx", f"model.onnx_path={model}",
            "data=synthetic", f"results_dir={rd}", "evaluate.plot=true", *QUICK, *extra]  # QUICK: plain quantize


@pytest.mark.slow
def test_custom_metric_decides_and_is_reported(setup, tmp_path):
    model, env = setup
    rd = tmp_path / "r"
    proc = run_tune(_args(model, rd, ["accuracy.metric=custom", "accuracy.custom_metric=my_metrics.agreement",
                                      "accuracy.max_drop=5"]), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stages = json.loads((rd / "manifest.json").read_text())["stages"]
    assert "agreement" in stages["quantize"]["metrics"]["headline"]
    final = stages["autotune"]["metrics"]["accuracy"]["final"]
    assert final["metric"] == "custom" and final["custom_float"] == 100.0 and final["ok"]
    ev = stages["evaluate"]["metrics"]
    assert ev["custom_metric"]["name"] == "agreement" and ev["custom_metric"]["scores"]["float"] == 100.0
    report = (rd / "evaluate" / "report.md").read_text()
    assert "Custom metric `agreement` (`my_metrics.agreement`; higher is better)" in report
    assert (rd / "evaluate" / "summary.png").stat().st_size > 0


@pytest.mark.parametrize(("name", "says"), [
    ("boom", "accuracy.custom_metric=my_metrics.boom raised ValueError: no boxes in this batch"),
    ("nan", "accuracy.custom_metric=my_metrics.nan returned NaN"),
    ("missing", "accuracy.custom_metric=my_metrics.missing: module 'my_metrics' has no attribute 'missing'"),
])
def test_a_bad_metric_is_one_line_and_nothing_is_half_written(setup, tmp_path, name, says):
    model, env = setup
    rd = tmp_path / "r"
    proc = run_tune(_args(model, rd, ["accuracy.metric=custom", f"accuracy.custom_metric=my_metrics.{name}"]),
                    cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert says in proc.stderr.strip().splitlines()[-1]
    assert not (rd / "quantize" / "quantized_model.onnx").exists()
    assert not (rd / "quantize" / "calibration.json").exists()


def test_accuracy_outputs_must_name_outputs_of_the_model(tmp_path):
    model = models.save(models.conv_chain(), tmp_path, "m")
    proc = run_tune(_args(model, tmp_path / "r", ["accuracy.outputs=[embedding]"]), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("tune: error: accuracy.outputs: the model has no output "
                                                     "'embedding'; its outputs are logits")


@pytest.mark.slow
def test_a_model_judged_on_one_output_keeps_every_output(tmp_path):
    """Two outputs, only one judged: the shipped model still has both."""
    base = models.conv_chain()
    extra = onnx.helper.make_tensor_value_info("gap", onnx.TensorProto.FLOAT, [2, 8, 1, 1])
    base.graph.output.append(extra)
    path = tmp_path / "two.onnx"
    onnx.save(base, str(path))
    rd = tmp_path / "r"
    run_tune(_args(path, rd, ["accuracy.outputs=[logits]"]), cwd=tmp_path, check=True)
    final = onnx.load(str(rd / "autotune" / "optimized_final.onnx"))
    assert [o.name for o in final.graph.output] == ["logits", "gap"]
    verdict = json.loads((rd / "manifest.json").read_text())["stages"]["autotune"]["metrics"]["accuracy"]["final"]
    assert "gap" not in verdict["what"]
