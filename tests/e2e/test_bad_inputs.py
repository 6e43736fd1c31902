"""Bad input a new user gives: one line naming the key or input, what was given and what is needed;
exit 2; no traceback."""

from __future__ import annotations

import shutil

import numpy as np

from tests.helpers import run_tune


def _one_line_exit_2(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("tune: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


def test_npz_arrays_of_the_wrong_shape(digits_results, tmp_path):
    rd = tmp_path / "run"
    shutil.copytree(digits_results, rd)
    np.savez(tmp_path / "bad.npz", input=np.zeros((4, 3, 8, 8), np.float32))
    line = _one_line_exit_2(run_tune([f"results_dir={rd}", "stages=[quantize]", "data=npz",
                                      f"data.path={tmp_path / 'bad.npz'}"], cwd=tmp_path))
    assert "input 'input'" in line and "(3, 8, 8)" in line and "(1, 32, 32)" in line, line


def test_negative_input_size():
    line = _one_line_exit_2(run_tune(["model=resnet18", "model.input_size=-5", "stages=[export]"], cwd="/tmp"))
    assert "model.input_size=-5" in line and ">= 1" in line


def test_corrupt_autotuner_state(digits_results, tmp_path):
    rd = tmp_path / "run"
    shutil.copytree(digits_results, rd)
    (rd / "autotune").mkdir(exist_ok=True)
    (rd / "autotune" / "autotuner_state.yaml").write_text("patterns: {a: [1, 2\nversion: : :\n  - broken\n")
    line = _one_line_exit_2(run_tune([f"results_dir={rd}", "stages=[autotune]", "autotune.preset=quick"],
                                     cwd=tmp_path))
    assert "autotuner_state.yaml is corrupt" in line and "delete it" in line, line


def test_weights_over_the_calibration_memory_bound(digits_results, tmp_path):
    rd = tmp_path / "run"
    shutil.copytree(digits_results, rd)
    line = _one_line_exit_2(run_tune([f"results_dir={rd}", "stages=[quantize]",
                                      "quantize.calibration.max_memory_gb=0.00001"], cwd=tmp_path))
    assert "quantize.calibration.max_memory_gb=0.00 GB" in line and "weights alone take" in line, line
    assert "this machine has" in line, line
